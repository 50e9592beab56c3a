"""A live training dashboard for Jupyter (ipywidgets): curves, the latest samples, a Stop button.

    dash = Dashboard()
    display(dash)
    rlbits.train(config="configs/ppo_sentiment.yaml", callbacks=[dash])   # curves update every step

The loops call ``on_metrics(step, metrics)`` after each step, ``on_samples(step, rows)`` with a few
decoded rollouts, and ``should_stop()`` before the next step; when it returns True the loop finishes the
current step, saves a checkpoint and returns (``rlbits.loops.run``).

The Stop button: while a cell runs, Jupyter queues widget events until the cell ends, so a click reaches
the kernel only if training runs outside the cell. ``dash.train(...)`` does that: it runs ``rlbits.train``
in a background thread and returns at once; ``dash.wait()`` blocks until it ends. A ``KeyboardInterrupt``
(the notebook's stop square) stops a foreground run the same clean way.
"""

from __future__ import annotations

import html
import io
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlbits.viz.plots import series

# (title, metrics) of each panel; a line appears when its metric first arrives.
DEFAULT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("rewards", "val_reward")),
    ("KL to reference", ("init_policy_kl", "kl_loss")),
    ("loss", ("actor_loss", "critic_loss", "loss")),
    ("entropy", ("entropy",)),
)
# Shown in the status line when logged.
STATUS_KEYS = ("rewards", "val_reward", "init_policy_kl", "time/step")


class Dashboard:
    """Live curves, a table of the latest samples and a Stop button; pass it as a training callback.

    Args:
        panels: ``(title, metric names)`` per plot panel; default reward, KL, loss, entropy.
        max_samples: rows of the samples table (the latest step's first rollouts).
        redraw_every: render the figure every this many ``on_metrics`` calls (rendering costs ~0.1 s).

    Attributes:
        history: every ``{"step": ..., **metrics}`` received, in order.
        samples: the latest rows passed to ``on_samples`` (each with its ``step``).
        figure: the matplotlib ``Figure``; each line's label is its metric and holds the logged values.
        button, status, image, table: the widgets; ``widget`` is the whole box (what ``display`` shows).
        run_dir, error: set by a background ``train`` when it returns or raises.
    """

    def __init__(
        self,
        panels: Sequence[tuple[str, Sequence[str]]] = DEFAULT_PANELS,
        *,
        max_samples: int = 8,
        redraw_every: int = 1,
    ) -> None:
        import ipywidgets as widgets
        from matplotlib.figure import Figure

        if redraw_every < 1:
            raise ValueError(f"redraw_every must be >= 1, got {redraw_every}")
        self.panels = [(title, tuple(keys)) for title, keys in panels]
        self.max_samples = max_samples
        self.redraw_every = redraw_every
        self.history: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.run_dir: Path | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._updates = 0
        # A bare Figure (not pyplot): the inline backend does not show it again at the end of the cell.
        cols = 2
        rows = -(-len(self.panels) // cols)
        self.figure = Figure(figsize=(9, 2.4 * rows))
        self._axes = {
            title: self.figure.add_subplot(rows, cols, i + 1) for i, (title, _) in enumerate(self.panels)
        }
        for title, ax in self._axes.items():
            ax.set_title(title, fontsize=9)
            ax.tick_params(labelsize=7)
        self._lines: dict[str, Any] = {}
        self.button = widgets.Button(description="Stop", button_style="danger", icon="stop",
                                     tooltip="finish the current step, save a checkpoint and stop")
        self.button.on_click(self._on_stop)
        self.status = widgets.HTML(value="waiting for the first step")
        self.image = widgets.Image(format="png", layout=widgets.Layout(max_width="900px"))
        self.table = widgets.HTML()
        self.widget = widgets.VBox([widgets.HBox([self.button, self.status]), self.image, self.table])

    # --- the callback protocol of rlbits.loops.run ----------------------------------------------------

    def on_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        """Append the step's metrics, extend the curves and refresh the status line."""
        self.history.append({"step": step, **metrics})
        for title, keys in self.panels:
            for key in keys:
                if metrics.get(key) is not None:
                    self._extend(title, key)
        shown = [f"<b>step {step}</b>"] + [
            f"{k} {metrics[k]:.4g}" for k in STATUS_KEYS if metrics.get(k) is not None
        ]
        if self._stop.is_set():
            shown.append("<i>stopping after this step</i>")
        self.status.value = " &middot; ".join(shown)
        self._updates += 1
        if self._updates % self.redraw_every == 0:
            self.redraw()

    def on_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Show the first ``max_samples`` of the step's decoded rollouts."""
        self.samples = [{"step": step, **row} for row in list(samples)[: self.max_samples]]
        self.table.value = samples_table(self.samples)

    def should_stop(self) -> bool:
        """True once the Stop button was clicked (or ``stop()`` called)."""
        return self._stop.is_set()

    # --- controls ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the run to end after its current step (what the Stop button does)."""
        self._stop.set()
        self.button.disabled = True
        self.button.description = "Stopping"

    def _on_stop(self, _button: Any) -> None:
        self.stop()

    def train(self, *args: Any, callbacks: Sequence[Any] = (), **kwargs: Any) -> threading.Thread:
        """Run ``rlbits.train(*args, callbacks=[self, *callbacks], **kwargs)`` in a background thread, so
        the cell returns and the Stop button stays clickable. ``wait()`` joins it; ``run_dir`` or ``error``
        hold the outcome. Raises RuntimeError if a run of this dashboard is still going."""
        from rlbits.loops.api import train

        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(
                "this dashboard is already following a run; wait() for it or make a new Dashboard"
            )
        self._stop.clear()
        self.button.disabled = False
        self.button.description = "Stop"

        def target() -> None:
            try:
                self.run_dir = train(*args, callbacks=[self, *callbacks], **kwargs)
                self.status.value += " &middot; <b>done</b>"
            except BaseException as e:  # shown in the dashboard and re-raised by wait()
                self.error = e
                self.status.value = f"<b style='color:#b00'>failed: {html.escape(repr(e))}</b>"
            finally:
                self.button.disabled = True
                self.redraw()

        self._thread = threading.Thread(target=target, name="rlbits-train", daemon=True)
        self._thread.start()
        return self._thread

    def wait(self, timeout: float | None = None) -> Path | None:
        """Block until the background run ends; returns its run directory, re-raises its error."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.run_dir

    # --- drawing ------------------------------------------------------------------------------------

    def _extend(self, title: str, key: str) -> None:
        ax = self._axes[title]
        xs, ys = series(self.history, key)
        if key not in self._lines:
            (self._lines[key],) = ax.plot(xs, ys, marker=".", markersize=3, linewidth=1, label=key)
            ax.legend(fontsize=7, loc="best")
        else:
            self._lines[key].set_data(xs, ys)
        ax.relim()
        ax.autoscale_view()

    def lines(self) -> dict[str, tuple[list[float], list[float]]]:
        """Metric -> ``(steps, values)`` as currently drawn."""
        return {key: (list(line.get_xdata()), list(line.get_ydata())) for key, line in self._lines.items()}

    def redraw(self) -> None:
        """Render the figure into the image widget."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(self.figure)
        self.figure.tight_layout()
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=80)
        self.image.value = buf.getvalue()

    def _repr_mimebundle_(self, **kwargs: Any):
        return self.widget._repr_mimebundle_(**kwargs)


def samples_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """An HTML table of sample rows (prompt, response, reward, ...); text is escaped, numbers rounded.

    A multi-turn episode's ``turns`` (a list of turn dicts, ``samples.jsonl``) is drawn turn by turn
    (``rlbits.viz.episodes.turns_html``, observations greyed) and stands for its ``response`` column."""
    from rlbits.viz.episodes import turns_html

    if not rows:
        return "<i>no samples</i>"
    if columns is None:
        columns = []
        for row in rows:
            columns += [k for k in row if k not in columns]
        if "turns" in columns:  # the turns hold the response's text, split
            columns = [c for c in columns if c != "response"]

    def cell(value: Any) -> str:
        if isinstance(value, list) and all(isinstance(t, Mapping) for t in value):
            return turns_html(value)
        if isinstance(value, float):
            return f"{value:.4g}"
        return html.escape(str(value)).replace("\n", "<br>")

    head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td style='text-align:left;font-family:monospace'>{cell(r.get(c, ''))}</td>" for c in columns
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


__all__ = ["DEFAULT_PANELS", "Dashboard", "samples_table"]
