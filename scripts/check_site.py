"""Render every page of the docs site in headless Chromium at 1280 px and fail on what a reader would see broken.

    python scripts/check_site.py                 # build the site (mkdocs build --strict) into a temp folder, check it
    python scripts/check_site.py --site build/site   # check a site already built

It fails (exit 1, one line per finding) on:

- a code block (`pre`) or a table wider than its column (content scrolled sideways by more than `--slack` px),
- an image wider than its column, or one that did not load (`naturalWidth` 0),
- a link to an anchor (`#id`, on the same page or another page of the site) that no element carries.

How: the site is served on 127.0.0.1 by a small HTTP server that also serves one driver page. Chromium opens the
driver once (`--headless=new --dump-dom`); the driver loads every page into its own 1280 px wide iframe, and when
they have all loaded (the driver's load event waits for its iframes) it measures each with the script below and
writes the findings into its own DOM, which `--dump-dom` prints. One browser start for the whole site keeps the
check to about a minute for ~50 pages on 2 cores.
Chromium is Debian's `chromium` package (`apt-get install -y chromium`); `--chromium PATH` names another binary.
"""

from __future__ import annotations

import argparse
import functools
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DRIVER = "/__site_check__.html"
WIDTH = 1280

#: Runs in the driver page: loads every page into an iframe and measures it (`check` reads the page's document).
DRIVER_SCRIPT = r"""
const SLACK = %(slack)d;
const WIDTH = %(width)d;
const pages = %(pages)s;
const results = {};
function describe(el) {
  const text = (el.innerText || el.getAttribute('alt') || el.getAttribute('src') || '').trim();
  return text.split('\n')[0].slice(0, 80);
}
function check(win, doc) {
  const found = [];
  const column = doc.querySelector('.md-content__inner') || doc.body;
  const columnWidth = column.getBoundingClientRect().width;
  for (const el of doc.querySelectorAll('pre, pre > code')) {
    const over = el.scrollWidth - el.clientWidth;
    if (el.clientWidth > 0 && over > SLACK) found.push(`code block ${over}px wider than its column: "${describe(el)}"`);
  }
  for (const table of doc.querySelectorAll('article table')) {
    const wrap = table.closest('.md-typeset__scrollwrap') || table.parentElement;
    const over = Math.max(wrap.scrollWidth - wrap.clientWidth, table.getBoundingClientRect().width - columnWidth);
    if (over > SLACK) found.push(`table ${Math.round(over)}px wider than its column: "${describe(table.rows[0] || table)}"`);
  }
  for (const img of doc.querySelectorAll('article img')) {
    if (!img.complete || img.naturalWidth === 0) { found.push(`broken image: ${img.getAttribute('src')}`); continue; }
    const over = img.getBoundingClientRect().width - columnWidth;
    if (over > SLACK) found.push(`image ${Math.round(over)}px wider than its column: ${img.getAttribute('src')}`);
  }
  const ids = Array.from(doc.querySelectorAll('[id]'), (el) => el.id)
    .concat(Array.from(doc.querySelectorAll('a[name]'), (el) => el.getAttribute('name')));
  const links = [];
  for (const a of doc.querySelectorAll('a[href*="#"]')) {
    const url = new URL(a.getAttribute('href'), win.location.href);
    if (url.origin === win.location.origin && url.hash.length > 1) links.push([url.pathname, decodeURIComponent(url.hash.slice(1))]);
  }
  return {found, ids, links};
}
// Every page loads at once, each in its own iframe; the driver's load event waits for all of them.
const frames = pages.map((page) => {
  const frame = document.createElement('iframe');
  frame.style.cssText = `width:${WIDTH}px;height:900px;border:0;display:block`;
  frame.src = page;
  document.body.appendChild(frame);
  return frame;
});
window.addEventListener('load', () => {
  frames.forEach((frame, index) => {
    try { results[pages[index]] = check(frame.contentWindow, frame.contentDocument); }
    catch (error) { results[pages[index]] = {found: [`the check failed: ${error}`], ids: [], links: []}; }
  });
  document.getElementById('out').textContent = JSON.stringify(results);
});
"""


def site_pages(site: Path) -> list[str]:
    """Every page's URL path (`/`, `/guides/rewards/`, ...), the 404 page left out."""
    paths = []
    for index in sorted(site.rglob("index.html")):
        relative = index.parent.relative_to(site).as_posix()
        paths.append("/" if relative == "." else f"/{relative}/")
    return paths


def driver_page(pages: list[str], slack: int) -> bytes:
    """The driver: an output element and the script that loads the pages into iframes and fills it."""
    script = DRIVER_SCRIPT % {"slack": slack, "width": WIDTH, "pages": json.dumps(pages)}
    body = f'<!doctype html><html><body style="margin:0"><pre id="out"></pre><script>{script}</script></body></html>'
    return body.encode()


class _Handler(http.server.SimpleHTTPRequestHandler):
    """The site's files, and the driver page at `DRIVER`."""

    driver: bytes = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == DRIVER:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(self.driver)))
            self.end_headers()
            self.wfile.write(self.driver)
            return
        super().do_GET()

    def log_message(self, *args: Any) -> None:
        pass  # one line per request would bury the findings


def serve(site: Path, driver: bytes) -> http.server.ThreadingHTTPServer:
    """Serve `site` and the driver on a free local port, in a daemon thread."""
    handler = type("Handler", (_Handler,), {"driver": driver})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def find_chromium(explicit: str | None) -> str:
    """The Chromium binary: `explicit`, else `chromium` / `chromium-browser` / `google-chrome` on PATH."""
    for name in [explicit] if explicit else ["chromium", "chromium-browser", "google-chrome"]:
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit(
        "check_site: no Chromium found (looked for chromium, chromium-browser, google-chrome); "
        "install it with `apt-get install -y chromium` or pass --chromium PATH"
    )


def render(chromium: str, url: str, pages: int, timeout: float) -> dict[str, Any]:
    """Open the driver in headless Chromium and return every page's findings."""
    with tempfile.TemporaryDirectory(prefix="check_site_profile_") as profile:
        command = [
            chromium,
            "--headless=new",
            "--no-sandbox",  # CI containers run as root
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={WIDTH + 40},1000",
            "--dump-dom",
            url,
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    match = re.search(r'<pre id="out">(.*?)</pre>', done.stdout, flags=re.S)
    if done.returncode != 0 or match is None or not match.group(1).strip():
        raise SystemExit(
            f"check_site: Chromium did not finish the pages (exit {done.returncode}); its stderr ends:\n"
            + done.stderr[-2000:]
        )
    return json.loads(html.unescape(match.group(1)))


def findings(results: dict[str, Any]) -> list[str]:
    """One line per problem: each page's own, then links to an anchor that the target page lacks."""
    lines = [f"{page}: {problem}" for page, result in results.items() for problem in result["found"]]
    ids = {page: set(result["ids"]) for page, result in results.items()}
    for page, result in results.items():
        for path, anchor in result["links"]:
            target = path if path.endswith("/") or path.endswith(".html") else path + "/"
            if target in ids and anchor not in ids[target]:
                lines.append(f"{page}: link to {path}#{anchor}, an anchor that page does not have")
    return sorted(dict.fromkeys(lines))


def build(site: Path) -> None:
    """`mkdocs build --strict` into `site`."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    mkdocs = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)]
    subprocess.run(mkdocs, cwd=ROOT, env=env, check=True)


def check(site: Path, chromium: str, slack: int, timeout: float) -> list[str]:
    """Every finding for the built site in `site`."""
    pages = site_pages(site)
    if not pages:
        raise SystemExit(f"check_site: no pages (index.html) under {site}")
    server = serve(site, driver_page(pages, slack))
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}{DRIVER}"
        results = render(chromium, url, len(pages), timeout)
    finally:
        server.shutdown()
    missing = sorted(set(pages) - set(results))
    return findings(results) + [f"{page}: not rendered" for page in missing]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", type=Path, default=None, help="a built site (default: build one into a temp dir)")
    parser.add_argument("--chromium", default=None, help="the Chromium binary (default: found on PATH)")
    parser.add_argument("--slack", type=int, default=4, help="px a block may overflow before it counts")
    parser.add_argument("--timeout", type=float, default=300, help="seconds Chromium may take for the whole site")
    args = parser.parse_args(argv)
    chromium = find_chromium(args.chromium)
    with tempfile.TemporaryDirectory(prefix="check_site_") as scratch:
        site = args.site or Path(scratch) / "site"
        if args.site is None:
            build(site)
        problems = check(site, chromium, args.slack, args.timeout)
        pages = len(site_pages(site))
    for line in problems:
        print(line)
    print(f"check_site: {pages} pages at {WIDTH} px, {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
