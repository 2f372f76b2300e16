"""The office task's files, made deterministically at task creation: the ledger spreadsheet
(.ods) and LibreOffice's user profile settings (registrymodifications.xcu)."""

from __future__ import annotations

import functools
import io
import zipfile
from collections.abc import Iterable
from xml.sax.saxutils import escape

from ._ods import TABLE_NS, TEXT_NS

ROWS = 100000  # a cold start of Calc on it: 1.2 s here (0.3 s without it); its save 1.2 s, its PDF 4.8 s
HEADERS = ("Id", "Item", "Qty", "Price", "Note")
NOTE_COLUMN = "E"
# The user profile's settings: no tip of the day, no first-run or what's-new infobar, no
# autosave or recovery data (timers that would write files behind the agent's back), no
# keep-format question on save, no autocomplete (Calc's AutoInput would complete typed text
# from the column's other entries).
REGISTRY = (
    ("org.openoffice.Office.Common/Misc", "ShowTipOfTheDay", "false"),
    ("org.openoffice.Office.Common/Misc", "FirstRun", "false"),
    ("org.openoffice.Office.Common/Misc", "CrashReport", "false"),
    ("org.openoffice.Office.Common/Misc", "UseOpenCL", "false"),
    ("org.openoffice.Office.Common/VCL", "UseSkia", "false"),
    ("org.openoffice.Office.Common/Save/Document", "WarnAlienFormat", "false"),
    ("org.openoffice.Office.Recovery/AutoSave", "Enabled", "false"),
    ("org.openoffice.Office.Recovery/RecoveryInfo", "Enabled", "false"),
    ("org.openoffice.Office.Calc/Input", "AutoInput", "false"),
    ("org.openoffice.Setup/Product", "ooSetupLastVersion", "7.4"),
)
# Debian's LibreOffice reads its configuration from /etc/libreoffice/registry (a symlink from
# /usr/lib/libreoffice/share/registry), and a workspace's /etc is generated without it: soffice
# then dies in its first ConfigItem ("RuntimeException", an abort). Debian keeps the pristine
# copies under /usr (ucf's originals), which every workspace sees.
PRISTINE_REGISTRY = "/usr/lib/libreoffice/share/.registry"


# ---- the spreadsheet, generated deterministically at task creation ----

def _qty(row: int) -> int:
    return (row * 7919) % 97 + 1


def _price(row: int) -> str:
    return f"{(row * 104729) % 10000 / 100:.2f}"


@functools.lru_cache(maxsize=4)  # a second or so for the full ledger; every make_env of a seed wants it
def ledger_ods(rows: int = ROWS) -> bytes:
    """A ledger of `rows` items (Id, Item, Qty, Price, an empty Note; headers on row 1) as an
    .ods: the same bytes every time (fixed zip dates, no meta.xml clock)."""
    head = "".join(f'<table:table-cell office:value-type="string"><text:p>{h}</text:p></table:table-cell>'
                   for h in HEADERS)
    body = [f"<table:table-row>{head}</table:table-row>"]
    for r in range(1, rows + 1):
        q, p = _qty(r), _price(r)
        body.append(
            "<table:table-row>"
            f'<table:table-cell office:value-type="float" office:value="{r}"><text:p>{r}</text:p></table:table-cell>'
            f'<table:table-cell office:value-type="string"><text:p>item-{r:05d}</text:p></table:table-cell>'
            f'<table:table-cell office:value-type="float" office:value="{q}"><text:p>{q}</text:p></table:table-cell>'
            f'<table:table-cell office:value-type="float" office:value="{p}"><text:p>{p}</text:p></table:table-cell>'
            "<table:table-cell/></table:table-row>")
    content = ('<?xml version="1.0" encoding="UTF-8"?>\n<office:document-content '
               'xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" '
               f'xmlns:table="{TABLE_NS}" xmlns:text="{TEXT_NS}" office:version="1.2">'
               '<office:body><office:spreadsheet><table:table table:name="Ledger">'
               + "".join(body) + "</table:table></office:spreadsheet></office:body></office:document-content>")
    manifest = ('<?xml version="1.0" encoding="UTF-8"?>\n<manifest:manifest '
                'xmlns:manifest="urn:oasis:names:tc:opendocument:xmlns:manifest:1.0" manifest:version="1.2">'
                '<manifest:file-entry manifest:full-path="/" manifest:version="1.2" '
                'manifest:media-type="application/vnd.oasis.opendocument.spreadsheet"/>'
                '<manifest:file-entry manifest:full-path="content.xml" manifest:media-type="text/xml"/>'
                "</manifest:manifest>")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        # ODF: `mimetype` first and stored, so a reader can sniff the type at a fixed offset.
        for name, data, how in (("mimetype", "application/vnd.oasis.opendocument.spreadsheet", zipfile.ZIP_STORED),
                                ("content.xml", content, zipfile.ZIP_DEFLATED),
                                ("META-INF/manifest.xml", manifest, zipfile.ZIP_DEFLATED)):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = how
            z.writestr(info, data)
    return buf.getvalue()


def registry_xcu(items: Iterable[tuple[str, str, str]] = REGISTRY) -> str:
    """registrymodifications.xcu of a user profile holding `items` (path, property, value)."""
    props = "".join(f'<item oor:path="/{escape(path)}"><prop oor:name="{escape(name)}" oor:op="fuse">'
                    f"<value>{escape(value)}</value></prop></item>\n" for path, name, value in items)
    return ('<?xml version="1.0" encoding="UTF-8"?>\n<oor:items xmlns:oor="http://openoffice.org/2001/registry" '
            'xmlns:xs="http://www.w3.org/2001/XMLSchema" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">\n'
            + props + "</oor:items>\n")
