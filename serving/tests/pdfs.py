"""PDFs made on the spot for the upload tests: real files written by pypdf (text pages, encrypted,
blank, bombs), and hand-assembled ones where pypdf would refuse to write the damage.

No binary fixture is committed; every PDF a test uploads is built here from a few lines of text.
"""

from __future__ import annotations

import io
import zlib

from pypdf import PdfWriter
from pypdf.generic import ArrayObject, DecodedStreamObject, DictionaryObject, NameObject, NumberObject, StreamObject


def _escape(line: str) -> bytes:
    return line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)").encode("latin-1", "replace")


def text_content(text: str) -> bytes:
    """A content stream that shows `text` line by line in Helvetica (font resource /F1)."""
    shown = b" T* ".join(b"(" + _escape(line) + b") Tj" for line in text.split("\n"))
    return b"BT /F1 11 Tf 13 TL 72 740 Td " + shown + b" ET"


def _flate(data: bytes, writer: PdfWriter, **extra) -> object:
    stream = StreamObject()
    stream.set_data(zlib.compress(data, 9))
    stream[NameObject("/Filter")] = NameObject("/FlateDecode")
    stream[NameObject("/Length")] = NumberObject(len(stream._data))
    for key, value in extra.items():
        stream[NameObject(key)] = value
    return writer._add_object(stream)


def make_pdf(pages: list[str], *, password: str | None = None, contents: bytes | None = None,
             form: bytes | None = None, form_calls: int = 0) -> bytes:
    """One page per entry of `pages` showing that text. `contents` replaces every page's content
    stream with one shared compressed stream (for bombs); `form` adds a form XObject /Fm1 drawn
    `form_calls` times on each page."""
    writer = PdfWriter()
    font = writer._add_object(DictionaryObject({
        NameObject("/Type"): NameObject("/Font"), NameObject("/Subtype"): NameObject("/Type1"),
        NameObject("/BaseFont"): NameObject("/Helvetica")}))
    resources = DictionaryObject({NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})})
    if form is not None:
        form_ref = _flate(form, writer, **{"/Type": NameObject("/XObject"), "/Subtype": NameObject("/Form"),
                                          "/BBox": ArrayObject([NumberObject(0), NumberObject(0),
                                                                NumberObject(612), NumberObject(792)]),
                                          "/Resources": resources})
        resources[NameObject("/XObject")] = DictionaryObject({NameObject("/Fm1"): form_ref})
    shared = _flate(contents, writer) if contents is not None else None
    for text in pages:
        page = writer.add_blank_page(612, 792)
        page[NameObject("/Resources")] = resources
        if shared is not None:
            page[NameObject("/Contents")] = shared
            continue
        stream = DecodedStreamObject()
        stream.set_data(text_content(text) + b" /Fm1 Do" * form_calls)
        page[NameObject("/Contents")] = writer._add_object(stream)
        page.compress_content_streams()
    if password is not None:
        writer.encrypt(password)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def raw_pdf(objects: list[bytes], root: int = 1) -> bytes:
    """A PDF assembled from object bodies (object i + 1 is objects[i]) with a correct xref table:
    for damage pypdf's writer would not produce (deep nesting, page-tree bombs)."""
    out = io.BytesIO()
    out.write(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % number + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for offset in offsets:
        out.write(b"%010d 00000 n \n" % offset)
    out.write(b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, root, xref))
    return out.getvalue()


def page_tree_bomb(kids: int) -> bytes:
    """One page object listed `kids` times in the page tree: a few hundred kilobytes that claim
    to be a book."""
    return raw_pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Count %d /Kids [" % kids + b"3 0 R " * kids + b"] >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>",
    ])


def nested_arrays(depth: int) -> bytes:
    """A page whose /MediaBox is an array nested `depth` deep."""
    return raw_pdf([
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Count 1 /Kids [3 0 R] >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox " + b"[" * depth + b"]" * depth + b" >>",
    ])
