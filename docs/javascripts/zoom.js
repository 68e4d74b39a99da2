// Pictures open full size on click: the tutorials' figures (halo pictures, scaling plots) are
// drawn larger than the text column and their labels are unreadable scaled down.  A click shows
// the image at its natural size in an overlay that scrolls; a click or Escape closes it.  Works
// for the notebooks' inline (data:) images too, which a new tab would refuse to open.
// A picture without alt text gets the nearest heading above it as its description.
(function () {
  function headingBefore(node) {
    var all = Array.prototype.slice.call(document.querySelectorAll(".md-content h1, .md-content h2, .md-content h3"));
    var found = null;
    all.forEach(function (h) {
      if (h.compareDocumentPosition(node) & Node.DOCUMENT_POSITION_FOLLOWING) { found = h; }
    });
    return found ? found.textContent.replace(/¶$/, "").trim() : document.title;
  }

  function close(overlay) {
    overlay.remove();
    document.removeEventListener("keydown", overlay.onkey);
  }

  function open(img) {
    var overlay = document.createElement("div");
    overlay.className = "refimpl-zoom";
    overlay.setAttribute("role", "dialog");
    overlay.setAttribute("aria-label", img.alt + " (full size; click or Escape to close)");
    var big = document.createElement("img");
    big.src = img.currentSrc || img.src;
    big.alt = img.alt;
    overlay.appendChild(big);
    overlay.addEventListener("click", function () { close(overlay); });
    overlay.onkey = function (e) { if (e.key === "Escape") { close(overlay); } };
    document.addEventListener("keydown", overlay.onkey);
    document.body.appendChild(overlay);
  }

  function setup() {
    var pictures = [];
    document.querySelectorAll(".md-content img").forEach(function (img) {
      if (img.classList.contains("refimpl-zoomable") || img.closest("a")) { return; }
      var alt = img.getAttribute("alt") || "";
      if (!alt || /^No description has been provided/.test(alt)) {      // mkdocs-jupyter's placeholder
        img.setAttribute("alt", "figure: " + headingBefore(img));
      }
      img.classList.add("refimpl-zoomable");
      img.setAttribute("title", "click to open full size");
      img.addEventListener("click", function () { open(img); });
      pictures.push(img);
    });
    // a link to a page's N-th picture, full size: PAGE/#figure-N (1-based)
    var wanted = /^#figure-(\d+)$/.exec(window.location.hash);
    if (wanted && pictures[Number(wanted[1]) - 1]) { open(pictures[Number(wanted[1]) - 1]); }
  }

  if (window.document$ && window.document$.subscribe) {
    window.document$.subscribe(setup);      // Material's instant navigation
  } else {
    document.addEventListener("DOMContentLoaded", setup);
  }
})();
