"""Screenshots of the documentation site taken offline, to check what a reader sees.

Builds the site (``mkdocs build --strict`` into a scratch folder; the executed tutorials come
from the hook's cache when nothing changed) or takes a built one (``--site``), opens pages in
headless Chromium with networking disabled (every host resolves to nothing and every request
goes to a closed proxy port), waits for MathJax to typeset, and writes PNGs into OUT:

* ``NAME-top.png``: the first screen of the page (``--width`` x ``--height`` CSS pixels, times ``--scale``);
* ``NAME-figure-K.png``: each picture a tutorial page shows (the PNGs its run saved), with the
  lines printed just above it;
* ``NAME-ranks.png``: the first output of the page that lists every rank's lines (``[rank 1]``);
* ``NAME-math-K.png``: the first display formulas of a page with math.

Pages: tutorial 06 (the U-Net's blocks outlined), tutorial 09 (each rank's hyperslab) and the
derivations; ``--page`` takes other site paths. For each page it prints what it found: the
pictures, the typeset formulas (``mjx-container``) against the formulas on the page, raw TeX
left in its text, and any request the page made to another host (refused here: there should
be none).

Chromium is driven through the DevTools protocol on a pipe (``--remote-debugging-pipe``): only
the standard library is needed, and ``chromium`` on PATH (Debian: ``apt-get install chromium``).

    python scripts/site_screenshots.py /tmp/shots
    python scripts/site_screenshots.py /tmp/shots --site site --page reference/cli/
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("tutorials/06_unet_partitioned/", "tutorials/09_spatial_io/", "derivations/")
# no request leaves the machine: names resolve to nothing, and anything sent goes to port 9
OFFLINE = ("--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
           "--host-resolver-rules=MAP * ~NOTFOUND")
LOCAL_SCHEMES = ("file:", "data:", "about:", "blob:", "chrome:", "devtools:")

# what the page holds, in CSS pixels of the whole document
MEASURE = r"""
(() => {
  const box = (el, pad = 0) => {
    const r = el.getBoundingClientRect();
    return {x: Math.max(0, r.left + scrollX - pad), y: Math.max(0, r.top + scrollY - pad),
            width: r.width + 2 * pad, height: r.height + 2 * pad};
  };
  // a picture with the text output just above it (the "saved NAME.png" line, or a title)
  const figures = [...document.querySelectorAll(".jp-RenderedImage img")].map(img => {
    const child = img.closest(".jp-OutputArea-child");
    const prev = child && child.previousElementSibling;
    const b = box(img, 8);
    if (prev) { const p = box(prev, 8); b.height += b.y - p.y; b.y = p.y; }
    return b;
  });
  const ranks = [...document.querySelectorAll(".jp-OutputArea-output pre")]
    .filter(pre => pre.textContent.includes("[rank 1]")).map(pre => box(pre, 8));
  const math = [...document.querySelectorAll("div.arithmatex, .jp-RenderedMarkdown mjx-container[display]")]
    .map(el => box(el, 12));
  // TeX the reader would see as typed: a backslash command or a "$" left in the prose that
  // holds math (arithmatex elements, notebook markdown), code excluded
  const prose = [...document.querySelectorAll(".arithmatex, .jp-RenderedMarkdown")].map(el => {
    const copy = el.cloneNode(true);
    copy.querySelectorAll("code, pre, mjx-container").forEach(c => c.remove());
    return copy.textContent;
  }).join("\n");
  const raw = (prose.match(/\\[a-zA-Z]+|\$/g) || []).length;
  return {figures, ranks: ranks.slice(0, 1), math: math.slice(0, 3),
          formulas: document.querySelectorAll(".arithmatex").length,
          typeset: [...document.querySelectorAll(".arithmatex")]
                     .filter(el => el.querySelector("mjx-container")).length,
          notebook_math: document.querySelectorAll(".jp-RenderedMarkdown mjx-container").length, raw_tex: raw,
          title: document.title, height: document.documentElement.scrollHeight};
})()
"""
# MathJax typesets after load, asynchronously: wait for it (and for images to decode)
SETTLE = r"""
(async () => {
  const sleep = ms => new Promise(r => setTimeout(r, ms));
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  await Promise.all([...document.images].map(i => i.decode().catch(() => null)));
  // the page's own script typesets (docs/javascripts/mathjax.js): wait until it is done
  let last = -1;
  for (let i = 0; i < 50; i++) {
    const now = document.querySelectorAll("mjx-container").length;
    if (now === last) break;
    last = now;
    await sleep(400);
  }
  return true;
})()
"""


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4 of the child)."""

    def __init__(self, binary: str, width: int, height: int, scale: float = 1):
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        keep = (os.dup(to_child_r), os.dup(from_child_w))      # numbers above 4: dup2 cannot clash

        def fds():
            os.dup2(keep[0], 3)
            os.dup2(keep[1], 4)

        self._profile = tempfile.mkdtemp(prefix="site-shots-profile-")
        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--remote-debugging-pipe", f"--user-data-dir={self._profile}", "--no-first-run",
             "--disable-extensions", "--disable-background-networking", "--disable-sync",
             "--disable-component-update", "--disable-default-apps", "--mute-audio",
             f"--window-size={width},{height}", *OFFLINE, "about:blank"],
            preexec_fn=fds, pass_fds=(3, 4), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in (to_child_r, from_child_w, *keep):
            os.close(fd)
        self._buffer, self._next, self.events = b"", 0, []
        self.width, self.height, self.scale = width, height, scale

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 60) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe (did it start?)")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def wait_event(self, method: str, session: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, event in enumerate(self.events):
                if event.get("method") == method and event.get("sessionId") == session:
                    return self.events.pop(i)
            self.events.append(self._receive(deadline))

    def open(self, url: str) -> tuple[str, str]:
        """Load ``url`` in a new tab, wait for its load event and for MathJax; (session, target)."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Network", "Runtime"):
            self.send(f"{domain}.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                         "deviceScaleFactor": self.scale, "mobile": False},
                  session=session)
        self.events.clear()
        self.send("Page.navigate", {"url": url}, session=session)
        self.wait_event("Page.loadEventFired", session)
        self.evaluate(SETTLE, session)
        return session, target

    def evaluate(self, expression: str, session: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, session=session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def requests(self, session: str) -> list[str]:
        """Every URL the page asked for that is not on this machine (none is reachable here)."""
        urls = [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == session]
        return sorted({u for u in urls if not u.startswith(LOCAL_SCHEMES)})

    def screenshot(self, session: str, path: Path, clip: dict | None = None) -> None:
        params = {"format": "png"}
        if clip:
            params.update(clip={**clip, "scale": 1}, captureBeyondViewport=True)
        data = self.send("Page.captureScreenshot", params, session=session)["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)


def build_site(into: Path) -> Path:
    print(f"building the site into {into} (mkdocs build --strict; minutes when the tutorials must run)",
          flush=True)
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                    "-f", str(ROOT / "mkdocs.yml"), "-d", str(into)], cwd=ROOT, env=env, check=True)
    return into


def shoot(browser: Chromium, site: Path, page: str, out: Path, math_shots: int) -> dict:
    html = site / page / "index.html" if not page.endswith(".html") else site / page
    if not html.is_file():
        raise SystemExit(f"{html}: no such page in the site")
    name = page.strip("/").split("/")[-1].removesuffix(".html") or "index"
    session, target = browser.open(html.resolve().as_uri())
    found = browser.evaluate(MEASURE, session)
    shots = [out / f"{name}-top.png"]
    browser.screenshot(session, shots[0])
    for k, clip in enumerate(found["figures"], 1):
        shots.append(out / f"{name}-figure-{k}.png")
        browser.screenshot(session, shots[-1], clip)
    for clip in found["ranks"]:
        clip["height"] = min(clip["height"], 900)
        shots.append(out / f"{name}-ranks.png")
        browser.screenshot(session, shots[-1], clip)
    for k, clip in enumerate(found["math"][:math_shots], 1):
        shots.append(out / f"{name}-math-{k}.png")
        browser.screenshot(session, shots[-1], clip)
    external = browser.requests(session)
    browser.send("Target.closeTarget", {"targetId": target})
    print(f"{page}: {found['title']!r}, {found['height']} px tall; {len(found['figures'])} picture(s); "
          f"{found['typeset']} of {found['formulas']} arithmatex formula(s) typeset, "
          f"{found['notebook_math']} in notebook markdown; "
          f"raw TeX left in the text: {found['raw_tex']}; requests to other hosts: {external or 'none'}")
    for shot in shots:
        print(f"  {shot}")
    return {"page": page, "external": external, "raw_tex": found["raw_tex"], "shots": [str(s) for s in shots]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for the PNGs (created)")
    parser.add_argument("--site", type=Path,
                        help="a built site (mkdocs build -d DIR); default: build one now "
                             "(mkdocs build --strict, tutorials from the hook's cache)")
    parser.add_argument("--page", action="append", metavar="PATH",
                        help="a page of the site, e.g. reference/cli/ (repeatable; default: "
                             f"{' '.join(PAGES)})")
    parser.add_argument("--width", type=int, default=1280, help="window width, CSS pixels (default 1280)")
    parser.add_argument("--height", type=int, default=1600,
                        help="window height of NAME-top.png (default 1600)")
    parser.add_argument("--scale", type=float, default=2,
                        help="device pixels per CSS pixel (default 2: the pictures at their own resolution)")
    parser.add_argument("--math", type=int, default=2, help="display formulas shot per page (default 2)")
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM", "chromium"),
                        help="the browser binary (default: $CHROMIUM or chromium)")
    args = parser.parse_args(argv)
    binary = shutil.which(args.chromium)
    if binary is None:
        parser.error(f"{args.chromium} not found (Debian: apt-get install chromium)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="site-shots-") as scratch:
        site = args.site.resolve() if args.site else build_site(Path(scratch) / "site")
        browser = Chromium(binary, args.width, args.height, args.scale)
        try:
            results = [shoot(browser, site, page, args.out, args.math) for page in args.page or PAGES]
        finally:
            browser.close()
    bad = [r["page"] for r in results if r["external"]]
    if bad:
        print(f"pages that asked for other hosts: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
