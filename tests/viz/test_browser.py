"""The live dashboard in a real browser: JupyterLab runs a notebook whose Dashboard follows a background
training run, headless Chromium (Selenium) watches its curves and samples table update, clicks Stop, and
the run ends after the current step with a checkpoint.

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them with apt-get) and the
``dev`` extra (jupyterlab, selenium); skips with the reason where no browser can be found or started.
The screenshot of the stopped dashboard is saved next to the run directory (the path is printed)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the notebook trains a tiny policy

MAX_NUM_STEPS = 1000  # far more than the test waits for: the run is still stepping when Stop is clicked
KERNEL_TIMEOUT = 180  # a loaded 2-core machine: JupyterLab, the kernel, torch imports, the first step
PAGE_TIMEOUT = 120

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
DRIVERS = ("chromedriver",)


def _which(names) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook(tmp: Path) -> dict:
    """The notebook: a tiny policy folder, a displayed Dashboard, a long background run through it."""
    run = dict(
        loop="ppo",
        policy=str(tmp / "policy"),
        run_dir=str(tmp / "run"),
        max_num_steps=MAX_NUM_STEPS,
        num_prompts_per_step=4,
        max_new_tokens=5,
        microbatch_size=4,
        ppo_epochs=1,
        num_minibatches=1,
        val_period=0,
        val_at_start=False,
        val_at_end=False,
        save_period=0,
        log_samples=3,
        progress=False,
        tensorboard=False,
    )
    cells = [
        "import torch\n"
        "torch.set_num_threads(1)  # two cores, shared with JupyterLab and the browser\n"
        "from rlbits.models.load import save_pretrained\n"
        "from rlbits.models.tiny import tiny_causal_lm, tiny_tokenizer\n"
        f"save_pretrained(tiny_causal_lm('gpt2', seed=0), tiny_tokenizer(), {str(tmp / 'policy')!r})",
        "import rlbits\nfrom rlbits.viz import Dashboard\ndash = Dashboard()\ndisplay(dash)",
        "PROMPTS = ['the plot', 'a film', 'it was', 'my day', 'so this', 'hello', 'we saw', 'an end']\n"
        "def reward(prompts, responses):\n"
        "    return [min(r.count('a'), 4) / 4 for r in responses]\n"
        f"dash.train(reward_fn=reward, prompts=PROMPTS, config={run!r})\n"
        "print('training in the background')",
    ]
    return {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": f"cell{i}",
                "metadata": {},
                "outputs": [],
                "source": src,
            }
            for i, src in enumerate(cells)
        ],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def _lab_settings(settings_dir: Path) -> None:
    """User settings of the throwaway JupyterLab: every cell stays in the DOM (no virtual windowing) and
    no news or update toasts cover the page."""
    settings = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false",
            "checkForUpdates": False,
        },
    }
    for rel, value in settings.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


def _wait_for(what: str, check, timeout: float, interval: float = 0.5, on_timeout=None):
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as e:  # a stale element, a page still loading: poll again
            last_error = e
        time.sleep(interval)
    detail = on_timeout() if on_timeout is not None else ""
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last_error!r}) {detail}")


class JupyterLab:
    """A JupyterLab server on a free port with a random token, in its own process group."""

    def __init__(self, root: Path, tmp: Path) -> None:
        self.port = _free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "jupyterlab.log"
        env = dict(os.environ)
        env.update(
            JUPYTER_CONFIG_DIR=str(tmp / "jupyter_config"),  # no user config (a password, other settings)
            IPYTHONDIR=str(tmp / "ipython"),
            JUPYTER_RUNTIME_DIR=str(tmp / "jupyter_runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(tmp / "lab_settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(tmp / "lab_workspaces"),
            MPLBACKEND="Agg",
            OMP_NUM_THREADS="1",
        )
        _lab_settings(tmp / "lab_settings")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter",
                "lab",
                "--no-browser",
                "--ip",
                "127.0.0.1",
                "--port",
                str(self.port),
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={root}",
                "--ServerApp.port_retries=0",
                "--allow-root",
                "--ServerApp.terminals_enabled=False",
                "--LabApp.news_url=",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=root,
            start_new_session=True,
        )

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def api(self, path: str, method: str = "GET"):
        req = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
            return json.loads(body) if body else None

    def wait_ready(self, timeout: float) -> None:
        def ready():
            if self.proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {self.proc.returncode}:\n{self.log()}")
            try:
                return self.api("/api/status") is not None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                return False

        _wait_for("JupyterLab to answer", ready, timeout, on_timeout=self.log)

    def shutdown(self) -> None:
        """Ask the server to shut down (it stops its kernels), then end its process group."""
        try:
            if self.proc.poll() is None:
                try:
                    for kernel in self.api("/api/kernels") or []:
                        self.api(f"/api/kernels/{kernel['id']}", method="DELETE")
                    self.api("/api/shutdown", method="POST")
                    self.proc.wait(timeout=30)
                except Exception:
                    pass
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if self.proc.poll() is not None:
                    break
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            self._log.close()


def _start_browser(tmp: Path):
    """Headless Chromium through Selenium and the system chromedriver; skips with the reason if impossible."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the dev extra)")
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    browser, driver = _which(BROWSERS), _which(DRIVERS)
    if browser is None or driver is None:
        pytest.skip(
            "no headless browser: install Debian's chromium and chromium-driver "
            f"(found browser={browser}, chromedriver={driver})"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1600",
        "--no-first-run",
        "--disable-extensions",
        f"--user-data-dir={tmp / 'chromium_profile'}",
    ):
        options.add_argument(arg)
    try:
        return webdriver.Chrome(
            service=Service(executable_path=driver, log_output=str(tmp / "chromedriver.log")), options=options
        )
    except WebDriverException as e:
        pytest.skip(f"headless Chromium could not be started ({browser}, {driver}): {e.msg or e!r}"[:500])


# The dashboard's widgets as they render in the page; found by what they show.
STATUS_JS = """
const out = [];
for (const el of document.querySelectorAll('.widget-html-content, .widget-html')) {
  const m = el.textContent.match(/step (\\d+)/);
  if (m) out.push(el.textContent);
}
return out;
"""
IMAGE_JS = """
const imgs = [...document.querySelectorAll('img.widget-image, .widget-image img, img.jupyter-widgets')];
return imgs.map(i => [i.getAttribute('src') || '', i.naturalWidth]);
"""
TABLE_ROWS_JS = """
let n = 0;
for (const t of document.querySelectorAll('.widget-html-content table')) n += t.querySelectorAll('tbody tr').length;
return n;
"""


def _step_shown(driver) -> int | None:
    texts = driver.execute_script(STATUS_JS)
    steps = [int(m.group(1)) for t in texts for m in [re.search(r"step (\d+)", t)] if m]
    return max(steps) if steps else None


def _stop_button(driver):
    from selenium.webdriver.common.by import By

    for button in driver.find_elements(By.CSS_SELECTOR, "button.jupyter-button, .widget-button"):
        if button.text.strip() == "Stop":
            return button
    return None


def _run_all_cells(driver) -> None:
    """Run > Run All Cells, through the menu bar as a user would (the menu is opened again until the entry
    shows: the first click may land while the page still settles)."""
    from selenium.webdriver.common.by import By

    def run_all() -> bool:
        entries = [
            e
            for e in driver.find_elements(By.CSS_SELECTOR, '.lm-Menu-item[data-command="runmenu:run-all"]')
            if e.is_displayed()
        ]
        if entries:
            entries[0].click()
            return True
        for item in driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-item"):
            if item.text.strip() == "Run":
                item.click()
        return False

    _wait_for("Run > Run All Cells", run_all, PAGE_TIMEOUT, interval=1.0)


def test_dashboard_updates_and_stops_in_a_real_browser(tmp_path):
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (the dev extra)")
    from selenium.webdriver.common.by import By

    from rlbits.loops.run import read_metrics

    run_dir = tmp_path / "run"
    screenshot = run_dir.parent / "dashboard.png"
    (tmp_path / "dashboard.ipynb").write_text(json.dumps(_notebook(tmp_path), indent=1))

    driver = _start_browser(tmp_path)  # first: skip before starting a server when no browser can run
    lab = None
    try:
        lab = JupyterLab(tmp_path, tmp_path)
        lab.wait_ready(PAGE_TIMEOUT)
        driver.set_page_load_timeout(PAGE_TIMEOUT)
        driver.get(f"{lab.url}/lab/tree/dashboard.ipynb?token={lab.token}")

        def page_state() -> str:
            try:
                driver.save_screenshot(str(screenshot))
            except Exception:
                pass
            return f"(screenshot: {screenshot})\nJupyterLab log:\n{lab.log()}"

        # The notebook is open and its kernel is idle.
        _wait_for(
            "the notebook's cells",
            lambda: driver.find_elements(By.CSS_SELECTOR, ".jp-Notebook .jp-Cell"),
            PAGE_TIMEOUT,
            on_timeout=page_state,
        )
        _wait_for(
            "the kernel to start",
            lambda: any(k.get("execution_state") == "idle" for k in lab.api("/api/kernels")),
            KERNEL_TIMEOUT,
            on_timeout=page_state,
        )
        _run_all_cells(driver)

        # The dashboard renders and its status line counts steps.
        first = _wait_for(
            "the dashboard's first step", lambda: _step_shown(driver), KERNEL_TIMEOUT, on_timeout=page_state
        )
        first_images = {src for src, _ in driver.execute_script(IMAGE_JS)}
        later = _wait_for(
            f"the step counter to pass {first}",
            lambda: (s := _step_shown(driver)) is not None and s >= first + 2 and s,
            KERNEL_TIMEOUT,
            on_timeout=page_state,
        )
        assert later > first
        # The curves' image was re-rendered (a new PNG each step) and shows a real picture.
        _wait_for(
            "the plot image to update",
            lambda: any(
                src and src not in first_images and w > 100 for src, w in driver.execute_script(IMAGE_JS)
            ),
            PAGE_TIMEOUT,
            on_timeout=page_state,
        )
        # The samples table has rows.
        rows = _wait_for(
            "rows in the samples table",
            lambda: driver.execute_script(TABLE_ROWS_JS),
            PAGE_TIMEOUT,
            on_timeout=page_state,
        )
        assert rows >= 1

        # Stop in the page: the run ends after its current step, with a checkpoint.
        button = _wait_for(
            "the Stop button", lambda: _stop_button(driver), PAGE_TIMEOUT, on_timeout=page_state
        )
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", button)
        shown_at_click = _step_shown(driver)
        button.click()
        _wait_for(
            "the dashboard to say done",
            lambda: any("done" in t for t in driver.execute_script(STATUS_JS)),
            KERNEL_TIMEOUT,
            on_timeout=page_state,
        )
        page_state()  # the screenshot of the stopped dashboard
        print(f"\nscreenshot of the dashboard in Chromium: {screenshot}")

        steps = [r["step"] for r in read_metrics(run_dir)]
        assert steps == list(range(1, len(steps) + 1)), steps
        last = steps[-1]
        assert shown_at_click <= last < MAX_NUM_STEPS
        # The click stopped it: the run ended soon after (a few steps of click latency at most), not at its end.
        assert last - shown_at_click < 50, (shown_at_click, last)
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{last}"]
        assert _step_shown(driver) == last  # the page shows the last logged step
        disabled = driver.execute_script(
            "return [...document.querySelectorAll('button.jupyter-button')].filter(b => b.disabled)"
            ".map(b => b.textContent.trim())"
        )
        assert "Stopping" in disabled, disabled
    finally:
        try:
            driver.quit()
        finally:
            if lab is not None:
                lab.shutdown()
