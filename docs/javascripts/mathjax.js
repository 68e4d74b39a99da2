// MathJax 3, served from the site (assets/mathjax/, copied by scripts/mkdocs_hooks.py).
// Markdown pages: pymdownx.arithmatex (generic mode) writes \( ... \) inline and \[ ... \] display
// into elements of class "arithmatex". Tutorial pages (notebooks rendered by mkdocs-jupyter):
// $ ... $ and $$ ... $$ as typed in the cells' markdown, in elements of class "jp-RenderedMarkdown".
// Only those elements are typeset: a "$" anywhere else stays a dollar sign.
function typesetMath() {
  const mj = window.MathJax;
  if (!mj || !mj.typesetPromise) return Promise.resolve();     // not loaded yet: pageReady typesets
  mj.startup.output.clearCache();
  mj.typesetClear();
  mj.texReset();
  return mj.typesetPromise([...document.querySelectorAll(".arithmatex, .jp-RenderedMarkdown")]);
}
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true
  },
  startup: {
    typeset: false,
    pageReady: () => window.MathJax.startup.defaultPageReady().then(typesetMath)
  }
};
document$.subscribe(typesetMath);   // every page load, the instant navigation's included
