"""The built documentation site works offline and shows what it means to show.

Builds the site once (``mkdocs build --strict`` into a scratch folder; the tutorials' runs come
from the cache of scripts/mkdocs_hooks.py when tutorials and sources are unchanged, as after
tests/test_docs.py's build) and checks every page:

* no page loads a script or a stylesheet from another host (MathJax is served from the site,
  the theme's fonts are the system's, nbconvert's mermaid.js loader is removed);
* no page shows Markdown that did not render: ``!!!`` (an admonition outside the admonition
  extension, as in notebook cells) or a literal double backtick, in its text outside code;
* the tutorial pages come from their multi-rank runs: the rank count of the header, rank 0's
  outputs, every rank's lines marked ``[rank r]`` where they differ, and the pictures.

The parsing of the header's run line and the merging of the ranks' outputs are checked without
a build.
"""
import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMP_NUM_THREADS="1", NO_MKDOCS_2_WARNING="1")
EXTERNAL = re.compile(r"^\s*(?:https?:)?//", re.I)


def _hooks():
    """scripts/mkdocs_hooks.py, imported as a module."""
    pytest.importorskip("mkdocs", reason="pip install -e '.[docs]'")
    name = "refimpl_mkdocs_hooks"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "mkdocs_hooks.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module                       # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


# ------------------------------------------------------------------------------ no build

def test_a_hard_case_without_a_dtensor_row_is_named_under_the_table():
    """docs/peers.md as built: the hard suite's cases the table has no row for (added since
    the ~15-minute DTensor run) are listed right after it; nothing is added when every case
    has a row."""
    from refimpl.oracle import load_suite
    hooks = _hooks()
    page = (ROOT / "docs" / "peers.md").read_text()
    suite = {spec.file_name for spec in load_suite("hard")}
    rows = {line.split("|")[1].strip().strip("`") for line in page.splitlines() if line.startswith("| `")}
    assert hooks.hard_cases_without_rows(page) == sorted(suite - rows)
    row = next(line for line in page.splitlines() if line.startswith("| `groupnorm_spatial.2-2-1-1.h5`"))
    cut = page.replace(row + "\n", "")
    missing = sorted(suite - rows | {"groupnorm_spatial.2-2-1-1.h5"})
    built = hooks.hard_table_note(cut)
    note = f"**Not run under DTensor yet** ({len(missing)} case file{'s' if len(missing) > 1 else ''} added to the suite"
    assert note in built and ", ".join(f"`{name}`" for name in missing) + "." in built
    table_end = built.index("| `maxpool_ties.2-1-2-2.h5`")
    assert table_end < built.index(note) < built.index("Only the batch norms pass")
    full = page
    for name in sorted(suite - rows):            # a page with a row for every case: left as it is
        full = full.replace(row, row + "\n" + row.replace("groupnorm_spatial.2-2-1-1.h5", name), 1)
    assert hooks.hard_table_note(full) == full


@pytest.mark.parametrize("line, ranks", [
    ("#     mpiexec -n 4 python tutorials/06_x.py     (any number of ranks; 1 works too)", 4),
    ("#     mpiexec -n 4 --oversubscribe python tutorials/06_x.py     (any number of ranks)", 4),
    ("#     mpiexec --oversubscribe -n 3 python tutorials/06_x.py", 3),
    ("#     mpiexec -np 2 python3 tutorials/06_x.py", 2),
    ("#     python tutorials/06_x.py        (one process)", 1),
    ("#     mpiexec -n 8 python tutorials/07_other.py\n#     python tutorials/06_x.py", 1),
    ("# no command at all", 1),
])
def test_run_line_of_the_header(tmp_path, line, ranks):
    hooks = _hooks()
    script = tmp_path / "06_x.py"
    script.write_text(f"# %% [markdown]\n# # Tutorial 6 — x\n#\n{line}\n\n# %%\nx = 1\n", encoding="utf-8")
    run = hooks.tutorial_run(script)
    assert (run.ranks, run.script) == (ranks, "tutorials/06_x.py")
    assert run.command == (f"mpiexec -n {ranks} --oversubscribe python tutorials/06_x.py" if ranks > 1
                           else "python tutorials/06_x.py")


def test_every_tutorial_declares_its_run():
    hooks = _hooks()
    for tutorial in hooks.tutorial_files():
        run = hooks.tutorial_run(tutorial)
        assert run.script == f"tutorials/{tutorial.name}", tutorial.name
        assert 1 <= run.ranks <= 8, tutorial.name


def test_merge_ranks():
    merge = _hooks().merge_ranks
    assert merge(["a\n", "", "", ""]) == "a\n"                      # said by rank 0 only
    assert merge(["a\n", "a\n", "", "a\n"]) == "a\n"                # the same on every rank
    assert merge(["", "", ""]) == ""
    assert merge(["a\nb\n", "", "c\n"]) == "[rank 0] a\n[rank 0] b\n[rank 2] c\n"
    assert merge(["", "c"]) == "[rank 1] c\n"


def test_runner_runs_cells_per_rank(tmp_path):
    """The runner alone, one process: outputs per cell, a PNG a cell wrote, and a failing cell."""
    import json
    cells = tmp_path / "cells.json"
    cells.write_text(json.dumps([
        "import os, sys\nprint('one', __name__, os.path.basename(sys.argv[0]))",
        "open('pic.png', 'wb').write(b'png')\nimport sys\nprint('to stderr', file=sys.stderr)",
        "print('three')",
    ]))
    work = tmp_path / "cwd"
    work.mkdir()
    out = tmp_path / "out"
    script = tmp_path / "tutorials" / "01_x.py"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tutorial_runner.py"), str(cells), str(out),
                           str(script)], cwd=work, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rank0 = out / "rank0"
    assert (rank0 / "cell0.out").read_text() == "one __main__ 01_x.py\n"
    assert (rank0 / "cell1.err").read_text() == "to stderr\n"
    assert (rank0 / "cell2.out").read_text() == "three\n"
    assert (out / "figures" / "cell1-pic.png").read_bytes() == b"png"
    assert (rank0 / "done").exists()

    cells.write_text(json.dumps(["print('fine')", "1 / 0", "print('never')"]))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "tutorial_runner.py"), str(cells),
                           str(tmp_path / "out2"), str(script)], cwd=work, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "ZeroDivisionError" in proc.stderr and "cell 1" in proc.stderr
    assert (tmp_path / "out2" / "rank0" / "failed").read_text().strip() == "1"
    assert not (tmp_path / "out2" / "rank0" / "cell2.out").exists()


# ------------------------------------------------------------------------------ the built site

@pytest.fixture(scope="module")
def site(tmp_path_factory):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocs_jupyter", "jupytext", "nbformat"):
        pytest.importorskip(module, reason="pip install -e '.[docs]'")
    pytest.importorskip("mpi4py", reason="the tutorials run under mpiexec: pip install -e '.[mpi]'")
    out = tmp_path_factory.mktemp("site") / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return out


class _Page(HTMLParser):
    """A page's external references, its inline scripts and styles, and its text outside code
    (and outside mkdocs-jupyter's hidden copy of each cell's source, for the copy button)."""
    CODE = {"script", "style", "pre", "code", "textarea", "svg"}
    HIDDEN_CLASSES = {"clipboard-copy-txt"}
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
            "source", "track", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.external, self.text, self.scripts, self._open = [], [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script" and EXTERNAL.match(a.get("src") or ""):
            self.external.append(f"<script src={a['src']}>")
        if tag == "link" and EXTERNAL.match(a.get("href") or ""):
            rel = (a.get("rel") or "").lower()
            if rel in ("stylesheet", "preconnect", "preload", "modulepreload", "dns-prefetch") or a.get("as"):
                self.external.append(f"<link rel={rel} href={a['href']}>")
        if re.search(r"url\(\s*['\"]?(?:https?:)?//", a.get("style") or "", re.I):
            self.external.append(f"<{tag} style={a['style']}>")
        if tag not in self.VOID:
            hidden = bool(self.HIDDEN_CLASSES & set((a.get("class") or "").split()))
            self._open.append((tag, tag in self.CODE or hidden))

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self._open.pop()

    def handle_endtag(self, tag):
        if any(t == tag for t, _ in self._open):
            while self._open.pop()[0] != tag:
                pass

    def handle_data(self, data):
        if not any(skip for _, skip in self._open):
            self.text.append(data)
        elif self._open[-1][0] in ("script", "style"):
            self.scripts.append(data)


STYLE = re.compile(r"<style[^>]*>(.*?)</style>", re.S | re.I)


@pytest.fixture(scope="module")
def pages(site):
    """Every page of the site (MathJax's own files aside), parsed once: name -> _Page."""
    parsed = {}
    for path in sorted(site.rglob("*.html")):
        if "assets/mathjax" in path.as_posix():
            continue
        html = path.read_text(encoding="utf-8")
        page = _Page()
        page.scripts += STYLE.findall(html)              # the notebook pages' large stylesheets:
        page.feed(STYLE.sub("<style></style>", html))    # searched, not parsed
        page.close()
        parsed[path.relative_to(site).as_posix()] = page
    assert len(parsed) > 20
    return parsed


# in inline scripts and styles: a stylesheet imported, a font or image fetched, a module imported
INLINE_EXTERNAL = re.compile(r"@import\s+(?:url\()?\s*['\"]?(?:https?:)?//|url\(\s*['\"]?(?:https?:)?//"
                             r"|\bimport\s*\(\s*['\"`](?:https?:)?//"
                             r"|\bimport\s[^;'\"]*from\s*['\"](?:https?:)?//", re.I)


def test_no_page_loads_anything_from_another_host(site, pages):
    bad = {}
    for name, page in pages.items():
        found = page.external + [m.group(0) for text in page.scripts for m in INLINE_EXTERNAL.finditer(text)]
        if found:
            bad[name] = sorted(set(found))
    for css in sorted((site / "assets").rglob("*.css")) + sorted(site.glob("*.css")):
        found = INLINE_EXTERNAL.findall(css.read_text(encoding="utf-8", errors="replace"))
        if found:
            bad[css.relative_to(site).as_posix()] = sorted(set(found))
    assert not bad, f"pages that need the network: {bad}"


def test_mathjax_is_served_by_the_site(site):
    mathjax = site / "assets" / "mathjax"
    assert (mathjax / "tex-mml-chtml.js").is_file()
    assert list((mathjax / "output" / "chtml" / "fonts" / "woff-v2").glob("*.woff"))
    assert list((mathjax / "input" / "tex" / "extensions").glob("*.js"))       # loaded on demand
    derivations = (site / "derivations" / "index.html").read_text(encoding="utf-8")
    assert 'src="../assets/mathjax/tex-mml-chtml.js"' in derivations
    assert 'class="arithmatex"' in derivations


def test_pictures_open_full_size_and_wide_content_scrolls(site):
    """Every page loads the zoom script (a click opens a picture at its natural size; PAGE#figure-N
    opens the N-th) and the stylesheet that lets wide equations, tables, code and notebook
    outputs scroll instead of being cut."""
    for page in ("tutorials/02_splitting_a_sample/index.html", "derivations/index.html", "peers/index.html"):
        html = (site / page).read_text(encoding="utf-8")
        assert "javascripts/zoom.js" in html and "stylesheets/extra.css" in html, page
    css = (site / "stylesheets" / "extra.css").read_text()
    assert 'mjx-container[display="true"]' in css and "overflow-x: auto" in css and ".refimpl-zoom" in css
    script = (site / "javascripts" / "zoom.js").read_text()
    assert "#figure-" in script and "No description has been provided" in script


def test_no_page_shows_unrendered_markdown(pages):
    bad = {}
    for name, page in pages.items():
        text = "".join(page.text)
        found = [m.group(0) for m in re.finditer(r".{0,40}(?:!!!|``).{0,40}", text)]
        if found:
            bad[name] = found[:3]
    assert not bad, f"literal '!!!' or '``' in the rendered text: {bad}"


def test_tutorial_pages_show_their_multi_rank_runs(site):
    hooks = _hooks()
    for tutorial in hooks.tutorial_files():
        run = hooks.tutorial_run(tutorial)
        html = (site / "tutorials" / tutorial.stem / "index.html").read_text(encoding="utf-8")
        title = (f"Outputs of rank 0 of a {run.ranks}-rank run" if run.ranks > 1
                 else "Outputs of a one-process run")
        assert title in html, tutorial.name
        assert 'class="admonition note"' in html, tutorial.name
        assert "The outputs below are from one process" not in html
    # 03: every rank prints its own block and plan: each rank's lines, marked
    halo = (site / "tutorials" / "03_halo_exchange" / "index.html").read_text(encoding="utf-8")
    if hooks.tutorial_run(ROOT / "tutorials" / "03_halo_exchange.py").ranks > 1:
        assert "[rank 1] rank 1: coords" in halo
    # 06: the picture of the blocks, saved by rank 0 of the run
    unet = (site / "tutorials" / "06_unet_partitioned" / "index.html").read_text(encoding="utf-8")
    assert 'src="data:image/png' in unet
    # 07: with more than one rank, the model predicts a time (one rank: 0.00 ms)
    if hooks.tutorial_run(ROOT / "tutorials" / "07_allreduce.py").ranks > 1:
        allreduce = (site / "tutorials" / "07_allreduce" / "index.html").read_text(encoding="utf-8")
        predicted = [float(x) for x in re.findall(r"([\d.]+) ms predicted", allreduce)]
        assert predicted and all(p > 0 for p in predicted), predicted
