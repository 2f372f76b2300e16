"""Cells of a saved OpenDocument spreadsheet (.ods), with the standard library only.

The office family's read_cells tool and its verifier run this file inside the workspace
(`python3 ods_cells.py PATH REF...` prints the cells as JSON): a saved 100000-row ledger's
content.xml is tens of MB, and parsing it in the rollout's own process would hold that
process's GIL for a second per read. The workspace's python3 is the host's /usr/bin/python3;
nothing here imports bunshinrl.
"""

from __future__ import annotations

import json
import re
import sys
import zipfile
from collections.abc import Iterable, Iterator
from xml.etree import ElementTree

TABLE_NS = "urn:oasis:names:tc:opendocument:xmlns:table:1.0"
TEXT_NS = "urn:oasis:names:tc:opendocument:xmlns:text:1.0"
_CELL = re.compile(r"^([A-Z]{1,3})([1-9][0-9]{0,6})$")
# Calc's sheet (LibreOffice 7.4): columns A..AMJ, rows 1..1048576. A reference beyond it is no
# reference to Calc's Name Box, which would answer it with a dialog.
MAX_COLUMNS, MAX_ROWS = 1024, 1048576


def parse_cell(ref: str) -> tuple[int, int]:
    """'E1235' -> (column 4, row 1235): 0-based column, 1-based row."""
    m = _CELL.match(str(ref).strip().upper())
    if m is None:
        raise ValueError(f"not a cell reference: {ref!r} (a column letter and a row number, like E12)")
    col = 0
    for ch in m.group(1):
        col = col * 26 + ord(ch) - ord("A") + 1
    row = int(m.group(2))
    if col > MAX_COLUMNS or row > MAX_ROWS:
        raise ValueError(f"{ref!r} is outside the sheet (columns A to AMJ, rows 1 to {MAX_ROWS})")
    return col - 1, row


def _text(elem: ElementTree.Element) -> str:
    """A cell's text as Calc shows it: its paragraphs, with ODF's space, tab and break elements."""

    def inline(e: ElementTree.Element) -> Iterator[str]:
        yield e.text or ""
        for child in e:
            tag = child.tag.rsplit("}", 1)[-1]
            if tag == "s":
                yield " " * int(child.get(f"{{{TEXT_NS}}}c", "1"))
            elif tag == "tab":
                yield "\t"
            elif tag == "line-break":
                yield "\n"
            else:
                yield from inline(child)
            yield child.tail or ""

    return "\n".join("".join(inline(p)) for p in elem.iter(f"{{{TEXT_NS}}}p"))


def read_cells(source: str | zipfile.ZipFile, refs: Iterable[str]) -> dict[str, str]:
    """The text of cells (references like 'E12') of an .ods's first sheet, '' for an empty one,
    by reference as given (upper-cased). Reads content.xml as a stream and stops past the last
    row asked for. source: a path or an open zip."""
    want: dict[tuple[int, int], str] = {parse_cell(r): r.strip().upper() for r in refs}
    out = dict.fromkeys(want.values(), "")
    if not want:
        return out
    last = max(row for _c, row in want)
    row_tag, table_tag = f"{{{TABLE_NS}}}table-row", f"{{{TABLE_NS}}}table"
    cell_tags = (f"{{{TABLE_NS}}}table-cell", f"{{{TABLE_NS}}}covered-table-cell")
    z = source if isinstance(source, zipfile.ZipFile) else zipfile.ZipFile(source)
    with z, z.open("content.xml") as f:
        row = 1
        for _event, elem in ElementTree.iterparse(f, events=("end",)):
            if elem.tag == table_tag:
                break  # the first sheet only
            if elem.tag != row_tag:
                continue
            repeat = int(elem.get(f"{{{TABLE_NS}}}number-rows-repeated", "1"))
            here = [(c, name) for (c, r), name in want.items() if row <= r < row + repeat]
            col = 0
            for cell in elem if here else ():
                if cell.tag not in cell_tags:
                    continue
                span = int(cell.get(f"{{{TABLE_NS}}}number-columns-repeated", "1"))
                for c, name in here:
                    if col <= c < col + span:
                        out[name] = _text(cell)
                col += span
            row += repeat
            # Rows are dropped once read: a saved ledger's content.xml is tens of MB.
            elem.clear()
            if row > last:
                break
    return out


_PAGE = re.compile(rb"/Type\s*/Page(?![a-zA-Z])")


def is_whole(path: str) -> bool:
    """The file is a whole spreadsheet zip (its central directory there, content.xml listed):
    LibreOffice rewrites it in place, and a reader between its first and last block finds none."""
    try:
        with zipfile.ZipFile(path) as z:
            return "content.xml" in z.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def pdf_pages(data: bytes) -> int:
    """The pages of a PDF, counted by their page objects."""
    return len(_PAGE.findall(data))


def main(argv: list[str]) -> int:
    """`ods_cells.py PATH REF...`: the cells as a JSON object on stdout; exit 2 with the reason
    on stderr when PATH is no spreadsheet or a REF no cell. `--whole PATH`: exit 0 when PATH is
    a whole spreadsheet, 1 when not. `--pages PDF`: its page count. These run in the workspace so
    that the rollout's process never reads a file the workspace may have made of any size."""
    if argv[:1] == ["--whole"]:
        return 0 if is_whole(argv[1]) else 1
    if argv[:1] == ["--pages"]:
        with open(argv[1], "rb") as f:
            print(pdf_pages(f.read()))
        return 0
    try:
        print(json.dumps(read_cells(argv[0], argv[1:])))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, ElementTree.ParseError, IndexError) as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
