"""The case list's data files: the index of rows and one panel file per case (the page's script that reads them,
sorts, searches, filters and loads panels on demand is `templates/list.js`).

The page itself holds no case: the index (`<files>/cases.js`, one compact row per
case) is loaded by a script tag and calls `rescueIndex(data)`; each case's panel is
its own file (`<files>/case/<case id>.js`, calling `rescuePanel(id, html)`) injected
when its placeholder nears the viewport. Script tags, unlike fetch, work from
`file://`, so the report opens offline from a folder. The hash holds the view
(`#label=rescued&task=...&q=bowl&sort=-steps&page=2`, `#case=<id>`), so a view can be
shared and a test can open one.

Index format: `fields` (the row layout), `columns` ([key, title, kind]: case, label,
ok, num, text, href), `filters` ([key, title]), `search` (keys searched), `panels`
(whether cases have panel files), `prefix` (the files folder, relative to the page),
`page_size`, `rows`.
"""

from __future__ import annotations

import json
from typing import Any

# The functions the index and panel files call; the page's script (templates/list.js) defines them.
INDEX_CALLBACK = "rescueIndex"
PANEL_CALLBACK = "rescuePanel"


def index_script(data: dict[str, Any]) -> str:
    """The index file's text: one call handing the page its case rows."""
    return f"{INDEX_CALLBACK}({json.dumps(data, separators=(',', ':'))});\n"


def panel_script(case_id: str, html: str) -> str:
    """A case's panel file: one call handing the page the panel's markup."""
    return f"{PANEL_CALLBACK}({json.dumps(case_id)},{json.dumps(html)});\n"


def read_panel_script(text: str) -> tuple[str, str]:
    """(case id, markup) of a panel file (for tests and tools that read a report back)."""
    prefix = f"{PANEL_CALLBACK}("
    if not text.startswith(prefix) or not text.rstrip().endswith(");"):
        raise ValueError("not a report panel file")
    case_id, html = json.loads("[" + text[len(prefix):text.rstrip().rindex(")")] + "]")
    return case_id, html


def read_index_script(text: str) -> dict[str, Any]:
    """The index a page's `cases.js` holds."""
    prefix = f"{INDEX_CALLBACK}("
    if not text.startswith(prefix):
        raise ValueError("not a report index file")
    return json.loads(text[len(prefix):text.rstrip().rindex(")")])
