// The filter box above a generated list (docs/hooks/model_list.py): typing keeps the rows of
// the table after the box that contain every word typed, case-insensitive, and says how many.
(function () {
  function tableAfter(box) {
    for (let node = box.nextElementSibling; node; node = node.nextElementSibling) {
      const table = node.matches("table") ? node : node.querySelector("table");
      if (table) return table;
    }
    return null;
  }

  function attach(box) {
    const input = box.querySelector("input.table-filter");
    const count = box.querySelector(".table-filter-count");
    const table = tableAfter(box);
    if (!input || !table || input.dataset.ready) return;
    input.dataset.ready = "1";
    const rows = Array.from(table.tBodies[0].rows);
    const update = function () {
      const words = input.value.toLowerCase().split(/\s+/).filter(Boolean);
      let shown = 0;
      for (const row of rows) {
        const text = row.textContent.toLowerCase();
        const keep = words.every(function (w) { return text.includes(w); });
        row.style.display = keep ? "" : "none";
        if (keep) shown += 1;
      }
      count.textContent = shown + " of " + rows.length + " model types";
    };
    input.addEventListener("input", update);
    update();
  }

  function attachAll() {
    document.querySelectorAll(".table-filter-box").forEach(attach);
  }

  if (typeof document$ !== "undefined") {
    document$.subscribe(attachAll);  // Material's page-load observable (instant navigation too)
  } else {
    document.addEventListener("DOMContentLoaded", attachAll);
  }
})();
