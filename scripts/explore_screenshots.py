"""Screenshots of `qkv explore` for the README: each panel of the real page, in headless Chromium.

python scripts/explore_screenshots.py runs/lm docs/images     # needs the dev set-up (selenium, chromium)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

PANELS = {"sheet": (1200, 760), "weights": (1200, 900), "model": (1200, 1760), "positions": (1200, 640)}


def main(run: str, out: Path) -> None:
    """Start the explorer on `run`, open each panel, write out/explore-PANEL.png."""
    out.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen([sys.executable, "-m", "qkv", "explore", run, "--no-browser"], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    assert server.stdout is not None
    url = server.stdout.readline().split("serving ")[1].split()[0]
    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=options)
    try:
        for panel, (width, height) in PANELS.items():
            driver.set_window_size(width, height)
            driver.get(f"{url}#{panel}")
            while not driver.execute_script("return window.qkvExplore && window.qkvExplore.ready"):
                time.sleep(0.1)
            if panel == "sheet":  # the scale pushed up a little: the weights visibly sharpen
                driver.execute_script("const s = document.getElementById('sheet-scale'); s.value = 8;"
                                      "s.dispatchEvent(new Event('input'));")  # fmt: skip
            if panel == "model":
                for _ in range(12):
                    driver.find_element("id", "gen-step").click()
                    time.sleep(0.15)
            time.sleep(1.0)
            driver.execute_script("window.scrollTo(0, 0)")
            driver.save_screenshot(str(out / f"explore-{panel}.png"))
            print(f"wrote {out / f'explore-{panel}.png'}")
    finally:
        driver.quit()
        server.terminate()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
