"""Plots checked by their data: plot_run / plot_compare lines hold the logged values; plot_tokens colours
each token by its value; the rollout browser filters, sorts and pages the rows it was given."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from rlbits.models.tiny import tiny_tokenizer  # noqa: E402
from rlbits.viz import RolloutBrowser, plot_compare, plot_run, plot_tokens, tokens_html  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def write_run(path, rows, samples=()):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if samples:
        (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    return path


def lines_of(fig):
    return {
        ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
        for ax in fig.axes
        for ln in ax.get_lines()
    }


# --- plot_run ------------------------------------------------------------------------------------------


def test_plot_run_draws_the_logged_values_of_overlaid_runs(tmp_path):
    for name, scale in (("a", 1.0), ("b", 2.0)):
        rows = [{"step": s, "rewards": scale * s, "init_policy_kl": 0.1 * s} for s in (1, 2, 3)]
        write_run(tmp_path / name, rows)
    fig = plot_run([tmp_path / "a", tmp_path / "b"], out=tmp_path / "p.png")
    lines = lines_of(fig)
    assert lines["a: rewards"] == ([1, 2, 3], [1.0, 2.0, 3.0])
    assert lines["b: rewards"] == ([1, 2, 3], [2.0, 4.0, 6.0])
    assert lines["b: init_policy_kl"][1] == pytest.approx([0.1, 0.2, 0.3])
    # one colour per run, the same in every panel
    colour = {label: ln.get_color() for ax in fig.axes for ln in ax.get_lines() for label in [ln.get_label()]}
    assert colour["a: rewards"] == colour["a: init_policy_kl"] != colour["b: rewards"]
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_plot_run_covers_every_panel_and_skips_missing_values(tmp_path):
    row = {"rewards": 0.5, "val_reward": 0.4, "init_policy_kl": 0.2, "actor_loss": -0.1, "critic_loss": 0.3,
           "entropy": 2.0, "clipfrac": 0.05, "tokens_per_s": 900.0, "time/step": 1.5}
    rows = [{"step": s, **{k: v * s for k, v in row.items()}} for s in (1, 2)]
    rows[0]["val_reward"] = None  # non-finite values are written as null
    fig = plot_run(write_run(tmp_path / "r", rows), labels=["r"])
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["reward", "KL to reference", "actor loss", "critic loss", "entropy (nats/token)",
                      "clip fraction", "tokens / s", "seconds / step"]
    lines = lines_of(fig)
    assert lines["r: val_reward"] == ([2], [0.8])
    assert lines["r: tokens_per_s"] == ([1, 2], [900.0, 1800.0])
    assert lines["r: time/step"] == ([1, 2], [1.5, 3.0])


def test_plot_run_metrics_picks_the_panels_and_errors_are_clear(tmp_path):
    run = write_run(tmp_path / "r", [{"step": 1, "rewards": 1.0, "loss_q": 2.0}])
    fig = plot_run(run, metrics=["loss_q"])
    assert list(lines_of(fig)) == ["r: loss_q"]
    with pytest.raises(ValueError, match="logged nothing_here|nothing_here"):
        plot_run(run, metrics=["nothing_here"])
    with pytest.raises(ValueError, match="labels has 2 names for 1 runs"):
        plot_run(run, labels=["a", "b"])
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path / "nope")


def test_plot_compare_draws_the_mean_over_seeds_and_its_range(tmp_path):
    groups = {}
    for name, base in (("rloo", 0.0), ("grpo", 1.0)):
        groups[name] = [write_run(tmp_path / f"{name}{s}", [{"step": t, "val_reward": base + s + t} for t in (0, 5)])
                        for s in (0, 2)]
    fig = plot_compare(groups, "val_reward")
    lines = {ln.get_gid(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()}
    assert lines == {"rloo": ([0, 5], [1.0, 6.0]), "grpo": ([0, 5], [2.0, 7.0])}
    band = fig.axes[0].collections[0].get_paths()[0].vertices
    # the band runs from seed 0's value at step 0 to seed 2's at step 5
    assert band[:, 1].min() == 0.0 and band[:, 1].max() == 7.0
    with pytest.raises(ValueError, match="group 'x' has no runs"):
        plot_compare({"x": []})


# --- plot_tokens ----------------------------------------------------------------------------------------


def token_batch():
    tok = tiny_tokenizer()
    responses = torch.tensor([tok.encode("abc") + [0, 0], tok.encode("hi!") + tok.encode("x") + [0]])
    mask = responses != 0
    values = torch.tensor([[0.5, -1.0, 2.0, 0.0, 0.0], [-0.1, -2.0, -0.3, -0.7, 0.0]])
    batch = TensorDict({"responses": responses, "action_mask": mask, "advantages": values * mask,
                        "logprobs": -values.abs() * mask}, batch_size=[2])
    batch["prompt_text"] = ["p0", "p1"]
    return batch, tok


def test_plot_tokens_colours_each_token_by_its_value():
    batch, tok = token_batch()
    fig = plot_tokens(batch, "advantages", row=0, tokenizer=tok)
    texts = fig.axes[0].texts
    assert [t.get_text() for t in texts] == ["a", "b", "c"]  # padding is not drawn
    values = [float(t.get_gid()) for t in texts]
    assert values == [0.5, -1.0, 2.0]
    scale = fig.colorbar_mappable
    assert scale.norm.vmin == -2.0 and scale.norm.vmax == 2.0  # diverging, centred on 0
    for text, value in zip(texts, values, strict=True):
        assert text.get_bbox_patch().get_facecolor() == pytest.approx(scale.to_rgba(value))
    # blue for a positive advantage, red for a negative one (RdBu)
    rgb = [text.get_bbox_patch().get_facecolor() for text in texts]
    assert rgb[2][2] > rgb[2][0] and rgb[1][0] > rgb[1][2]
    assert "advantages" in fig.axes[0].get_title(loc="left") and "p0" in fig.axes[0].get_title(loc="left")


def test_plot_tokens_sequential_for_logprobs_and_accepts_a_tensor():
    batch, tok = token_batch()
    fig = plot_tokens(batch, "logprobs", row=1)
    texts = fig.axes[0].texts
    # without a tokenizer the labels are the token ids
    assert [t.get_text() for t in texts] == [str(i) for i in batch["responses"][1, :4].tolist()]
    scale = fig.colorbar_mappable
    assert (scale.norm.vmin, scale.norm.vmax) == pytest.approx((-2.0, -0.1))
    lowest = to_rgba(scale.cmap(0.0))
    assert texts[1].get_bbox_patch().get_facecolor() == pytest.approx(lowest)
    kl = torch.arange(10.0).reshape(2, 5)
    fig = plot_tokens(batch, kl, row=1, tokenizer=tok, center=0.0)
    assert [float(t.get_gid()) for t in fig.axes[0].texts] == [5.0, 6.0, 7.0, 8.0]
    assert fig.colorbar_mappable.norm.vmin == -8.0


def test_plot_tokens_errors_name_the_problem():
    batch, tok = token_batch()
    with pytest.raises(KeyError, match="no key 'values'.*advantages"):
        plot_tokens(batch, "values")
    with pytest.raises(IndexError, match="row 5"):
        plot_tokens(batch, "advantages", row=5)
    with pytest.raises(ValueError, match=r"\[2, 5\]"):
        plot_tokens(batch, torch.zeros(2, 3))


def test_tokens_html_holds_each_token_and_value():
    batch, tok = token_batch()
    html = tokens_html(batch, "advantages", 0, tokenizer=tok)
    assert html.count("<span") == 3 and 'title="-1"' in html and ">c</span>" in html


# --- rollout browser ------------------------------------------------------------------------------------


def test_rollout_browser_over_a_run_filters_sorts_and_pages(tmp_path):
    samples = [{"step": s, "prompt": f"p{i}", "response": f"r{i} {'good' if i % 2 else 'bad'}", "reward": float(i)}
               for s in (1, 2) for i in range(5)]
    run = write_run(tmp_path / "r", [{"step": 1, "rewards": 0.0}], samples)
    browser = RolloutBrowser(run, page_size=2)
    assert browser.step.value == 2  # the latest step first
    assert [r["prompt"] for r in browser.visible()] == ["p0", "p1"]
    assert browser.page.max == 2
    browser.page.value = 2
    assert [r["prompt"] for r in browser.visible()] == ["p4"]
    browser.sort.value = "reward: high to low"
    assert [r["reward"] for r in browser.visible()] == [4.0, 3.0] and browser.page.value == 0
    browser.filter.value = "good"
    assert [r["prompt"] for r in browser.matching()] == ["p3", "p1"]
    assert "r3 good" in browser.table.value and "r0 bad" not in browser.table.value
    browser.step.value = "all"
    assert len(browser.matching()) == 4
    with pytest.raises(FileNotFoundError, match="samples.jsonl"):
        RolloutBrowser(tmp_path / "nothing")


def test_rollout_browser_over_a_batch_colours_tokens():
    batch, tok = token_batch()
    batch["rewards"] = torch.tensor([0.25, -1.0])
    batch["response_text"] = ["abc", "hi!x"]
    browser = RolloutBrowser(batch, tokenizer=tok, key="advantages")
    rows = browser.visible()
    assert [(r["prompt"], r["response"], r["reward"]) for r in rows] == [
        ("p0", "abc", 0.25),
        ("p1", "hi!x", -1.0),
    ]
    assert browser.table.value.count("<span") == 7
    with pytest.raises(ValueError, match="key="):
        RolloutBrowser([{"prompt": "a"}], key="advantages")


# --- multi-turn episodes ---------------------------------------------------------------------------------


def episode_batch():
    """Two episodes by hand, as ``generate_episodes`` lays them out: row 0 = turn 0 "ab", observation "xy",
    turn 1 "c" (done); row 1 = one turn "hi" (eos), padded."""
    tok = tiny_tokenizer()
    e = tok.encode
    r0 = e("ab") + e("xy") + e("c")
    r1 = e("hi") + [0] * 3
    acts = [[True, True, False, False, True], [True, True, False, False, False]]
    batch = TensorDict(
        {
            "responses": torch.tensor([r0, r1]),
            "action_mask": torch.tensor(acts),
            "response_mask": torch.tensor([[True] * 5, [True, True, False, False, False]]),
            "turn_index": torch.tensor([[0, 0, 0, 0, 1], [0, 0, -1, -1, -1]]),
            "turn_rewards": torch.tensor([[0.0, 0.25, 0.0, 0.0, 1.0], [0.0, 0.5, 0.0, 0.0, 0.0]]),
            "logprobs": torch.tensor([[-0.5, -1.0, 0.0, 0.0, -2.0], [-0.1, -0.2, 0.0, 0.0, 0.0]]),
            "rewards": torch.tensor([1.25, 0.5]),
            "num_turns": torch.tensor([2, 1]),
        },
        batch_size=[2],
    )
    batch["prompt_text"] = ["p0", "p1"]
    batch["response_text"] = ["abxyc", "hi"]
    batch["stop_reason"] = ["done", "eos"]
    return batch, tok


class Spans(HTMLParser):
    """(class, style, text) of every span, and the text of every ``div.rlbits-turn`` / ``rlbits-episode``."""

    def __init__(self, html):
        super().__init__()
        self.spans, self.divs, self._open = [], [], None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("span", "div"):
            self._open = [tag, attrs.get("class", ""), attrs.get("style", ""), ""]

    def handle_data(self, data):
        if self._open is not None:
            self._open[3] += data

    def handle_endtag(self, tag):
        if self._open is not None and tag == self._open[0]:
            kind, cls, style, text = self._open
            (self.spans if kind == "span" else self.divs).append(
                (cls, style, text) if kind == "span" else text
            )
            self._open = None


def test_episode_turns_split_each_row_by_turn_and_mask():
    from rlbits.rollout.multiturn import episode_turns

    batch, tok = episode_batch()
    assert episode_turns(batch, 0, tok) == [
        {"turn": 0, "action": "ab", "observation": "xy", "action_tokens": 2, "observation_tokens": 2,
         "reward": 0.25},
        {"turn": 1, "action": "c", "observation": "", "action_tokens": 1, "observation_tokens": 0, "reward": 1.0},
    ]
    assert episode_turns(batch, 1) == [
        {"turn": 0, "action": tok.encode("hi"), "observation": [], "action_tokens": 2, "observation_tokens": 0,
         "reward": 0.5}
    ]
    with pytest.raises(KeyError, match="turn_index"):
        episode_turns(batch.exclude("turn_index"), 0)
    with pytest.raises(IndexError, match="row 2"):
        episode_turns(batch, 2)


def test_rollout_browser_draws_an_episode_batch_turn_by_turn():
    batch, tok = episode_batch()
    browser = RolloutBrowser(batch, tokenizer=tok, key="logprobs")
    page = Spans(browser.table.value)
    assert page.divs == ["2 turns · stop: done · reward 1.25", "turn 0 · reward 0.25", "turn 1 · reward 1",
                         "1 turn · stop: eos · reward 0.5", "turn 0 · reward 0.5"]
    kinds = [(cls, text) for cls, _, text in page.spans]
    assert kinds == [("rlbits-action", "a"), ("rlbits-action", "b"), ("rlbits-observation", "x"),
                     ("rlbits-observation", "y"), ("rlbits-action", "c"), ("rlbits-action", "h"),
                     ("rlbits-action", "i")]
    styles = {cls: style for cls, style, _ in page.spans}
    assert "italic" in styles["rlbits-observation"] and "italic" not in styles["rlbits-action"]
    # actions carry their logprob (colour and tooltip), observations none
    assert 'title="-0.5"' in browser.table.value and browser.table.value.count('title="observation') == 2
    row = browser.visible()[0]
    assert (row["num_turns"], row["stop_reason"], row["reward"]) == (2, "done", 1.25)
    assert [t["observation"] for t in row["turns"]] == ["xy", ""]


def test_logged_episode_samples_render_turns_and_single_turn_rows_are_unchanged(tmp_path):
    from rlbits.loops.run import sample_rows
    from rlbits.viz import samples_table

    batch, tok = episode_batch()
    rows = sample_rows(batch, 2, tokenizer=tok)
    assert [(r["num_turns"], r["stop_reason"], len(r["turns"])) for r in rows] == [
        (2, "done", 2),
        (1, "eos", 1),
    ]
    assert "turns" not in sample_rows(batch, 1)[0]  # no tokenizer: no texts per turn
    samples = [{"step": 1, **r} for r in rows]
    run = write_run(tmp_path / "r", [{"step": 1, "rewards": 0.0}], samples)
    browser = RolloutBrowser(run)
    page = Spans(browser.table.value)
    assert "turn 1 · reward 1" in page.divs and "2 turns · stop: done · reward 1.25" in page.divs
    assert [(cls, text) for cls, _, text in page.spans] == [
        ("rlbits-action", "ab"), ("rlbits-observation", "xy"), ("rlbits-action", "c"), ("rlbits-action", "hi"),
    ]
    # the dashboard's table draws the logged turns too, in place of the response column
    dash = Spans(samples_table(samples))
    assert ("rlbits-observation", "xy") in [(c, t) for c, _, t in dash.spans]

    # single-turn: the logged row and the browser's table are as before
    single = batch.exclude("turn_index", "turn_rewards", "num_turns", "stop_reason")
    assert sample_rows(single, 1, tokenizer=tok) == [{"prompt": "p0", "response": "abxyc", "reward": 1.25}]
    plain = [{"step": 1, "prompt": "p", "response": "r\nx", "reward": 0.5}]
    browser = RolloutBrowser(write_run(tmp_path / "s", [{"step": 1}], plain))
    assert browser.table.value == samples_table(plain)
    assert "rlbits-turn" not in browser.table.value and "rlbits-observation" not in browser.table.value


def test_plot_tokens_draws_observation_tokens_apart_with_tokens_response():
    batch, tok = episode_batch()
    fig = plot_tokens(batch, batch["action_mask"].float(), row=0, tokenizer=tok, tokens="response")
    texts = fig.axes[0].texts
    assert [t.get_text() for t in texts] == ["a", "b", "x", "y", "c"]
    assert [float(t.get_gid()) for t in texts] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert [t.get_style() for t in texts] == ["normal", "normal", "italic", "italic", "normal"]
    assert [t.get_bbox_patch().get_linestyle() for t in texts][1:3] == ["solid", "--"]
    assert [t.get_text() for t in plot_tokens(batch, "logprobs", row=0, tokenizer=tok).axes[0].texts] == list(
        "abc"
    )
    with pytest.raises(ValueError, match="tokens must be"):
        plot_tokens(batch, "logprobs", tokens="all")
