"""Turning an uploaded file into indexable text chunks, within fixed bounds.

A knowledge-base upload is untrusted input from a tenant's member. This module decides what a
file really is from its first bytes (not from its name or the browser's content type), accepts
only plain text, Markdown and PDFs that carry text, and extracts and chunks that text with
every resource bounded: bytes read from the upload, PDF pages, bytes decompressed per PDF
stream, content-stream bytes per PDF, characters per page and in total, characters per chunk.
Anything outside those bounds is refused with a sentence saying why (a ValidationError on the
`file` field with a stable `code`). It must never touch the database, never run an external
program, and never read more than the size limit plus one byte of an upload.
"""

from __future__ import annotations

import io
import itertools
import logging
import re
from collections.abc import Iterator
from pathlib import PurePosixPath

from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import InMemoryUploadedFile
from django.core.files.uploadhandler import FileUploadHandler, SkipFile

log = logging.getLogger("atrium.serving.ingest")

MAX_DOCUMENT_BYTES = 5 * 1024 * 1024
TEXT_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown"})
PDF_SUFFIXES = frozenset({".pdf"})
# What a browser or client may call a file we accept; anything else (image/png, application/zip)
# means the sender itself says the file is something we do not index.
NEUTRAL_TYPES = frozenset({"", "application/octet-stream", "binary/octet-stream"})
PDF_TYPES = frozenset({"application/pdf", "application/x-pdf"})
TEXT_TYPES = frozenset({"application/x-markdown", "application/markdown"})  # plus every text/*

# Text that is prose (or Markdown, or code) and not something else wearing a .txt name.
MAX_CONTROL_SHARE = 0.01  # control characters other than tab/newline/form feed
MIN_WORD_SHARE = 0.25  # letters and digits among the non-space characters; real docs have 0.75+
MAX_RUN_CHARS = 20_000  # characters without a space: longer is an embedded blob, not words
MAX_NESTING = 64  # blockquote markers on one line, or opening brackets in a row

# PDF bounds. pypdf is pure Python and slow (about 15 µs per decoded content byte on a loaded
# two-core machine, ~50 ms for a dense page), so the content budget is what bounds the time of
# an upload (about 30 s at worst there); the rest bound memory.
PDF_MAX_PAGES = 500
PDF_MAX_CONTENT_BYTES = 2 * 1024 * 1024  # decoded page content streams and the forms they draw, per file
PDF_MAX_FORM_CALLS = 20  # form XObjects drawn while extracting one page's text
PDF_MAX_STREAM_BYTES = 8 * 1024 * 1024  # any one stream, decompressed: the decompression-bomb guard
PDF_MAX_STREAM_TOKENS = 250_000  # operands and operators parsed in one content stream
PDF_MAX_PAGE_CHARS = 100_000  # a dense page of text is about 5,000
PDF_MAX_TEXT_CHARS = MAX_DOCUMENT_BYTES

CHUNK_WORDS = 160
CHUNK_OVERLAP = 30
CHUNK_MAX_CHARS = 4_000  # a chunk ends up in a model's prompt: bounded in characters too
WORD_PIECE_CHARS = 500  # a longer word is cut into pieces this long
_SLICE_CHARS = 64 * 1024  # text is scanned in slices this long, to bound temporary lists


def refuse(message: str, code: str) -> ValidationError:
    return ValidationError({"file": ValidationError(message, code=code)})


# --- reading the upload -----------------------------------------------------------------


def read_bounded(source, limit: int = MAX_DOCUMENT_BYTES) -> bytes:
    """The bytes of `source` (bytes or a binary file object), reading at most limit + 1 of them:
    one byte more than allowed is enough to know the file is too large."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source[: limit + 1])
    else:
        # one read of everything allowed (a stream may return less: then read on); an in-memory
        # upload hands its buffer over without a copy
        parts, have = [], 0
        while have <= limit:
            part = source.read(limit + 1 - have)
            if not part:
                break
            parts.append(part)
            have += len(part)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
    if len(data) > limit:
        raise refuse(f"files are limited to {limit // (1024 * 1024)} MiB", "too_large")
    if not data:
        raise refuse("the file is empty", "empty")
    return data


class BoundedUploadHandler(FileUploadHandler):
    """Keeps the first limit + 1 bytes of the one `file` field in memory and drops the rest as it
    arrives, so an upload of any size costs at most limit + 1 bytes of memory and no disk. Any
    other file field is skipped. The view sees a file of limit + 1 bytes and refuses it."""

    field = "file"

    def __init__(self, request=None, limit: int = MAX_DOCUMENT_BYTES):
        super().__init__(request)
        self.limit = limit
        self.kept = 0
        self.received = 0
        self.taken = False
        self.parts: list[bytes] | None = None

    def new_file(self, field_name, file_name, content_type, content_length, charset=None, content_type_extra=None):
        super().new_file(field_name, file_name, content_type, content_length, charset, content_type_extra)
        if field_name != self.field or self.taken:
            raise SkipFile
        self.taken = True
        self.parts = []

    def receive_data_chunk(self, raw_data, start):
        self.received += len(raw_data)
        room = self.limit + 1 - self.kept
        if room > 0:
            self.parts.append(raw_data[:room])
            self.kept += min(room, len(raw_data))
        # returning nothing: the chunk is consumed here and no later handler buffers it

    def file_complete(self, file_size):
        if self.parts is None:
            return None
        # one exact-size bytes object, which BytesIO shares instead of copying, and which a
        # single read() of all of it hands on as it is
        data = b"".join(self.parts)
        self.parts = []
        return InMemoryUploadedFile(file=io.BytesIO(data), field_name=self.field_name, name=self.file_name,
                                    content_type=self.content_type, size=self.kept, charset=self.charset,
                                    content_type_extra=self.content_type_extra)


# --- what the file is -------------------------------------------------------------------

# (prefix, offset, what) — formats whose first bytes say what they are.
_MAGIC: tuple[tuple[bytes, int, str], ...] = (
    (b"%PDF-", 0, "a PDF document"),
    (b"\x89PNG\r\n\x1a\n", 0, "a PNG image"),
    (b"\xff\xd8\xff", 0, "a JPEG image"),
    (b"GIF87a", 0, "a GIF image"),
    (b"GIF89a", 0, "a GIF image"),
    (b"PK\x03\x04", 0, "a ZIP archive (or an Office document)"),
    (b"PK\x05\x06", 0, "a ZIP archive"),
    (b"\x7fELF", 0, "an ELF executable"),
    (b"\x1f\x8b", 0, "gzip-compressed data"),
    (b"\xfd7zXZ\x00", 0, "xz-compressed data"),
    (b"7z\xbc\xaf\x27\x1c", 0, "a 7-Zip archive"),
    (b"\x28\xb5\x2f\xfd", 0, "zstd-compressed data"),
    (b"Rar!\x1a\x07", 0, "a RAR archive"),
    (b"1AY&SY", 4, "bzip2-compressed data"),
    (b"\xca\xfe\xba\xbe", 0, "a Java class or Mach-O executable"),
    (b"\xcf\xfa\xed\xfe", 0, "a Mach-O executable"),
    (b"\xce\xfa\xed\xfe", 0, "a Mach-O executable"),
    (b"\x00asm", 0, "a WebAssembly module"),
    (b"SQLite format 3\x00", 0, "an SQLite database"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", 0, "an old-style Office document"),
    (b"ftyp", 4, "an MP4/QuickTime/HEIC media file"),
    (b"OggS", 0, "an Ogg media file"),
    (b"fLaC", 0, "a FLAC audio file"),
    (b"\x1a\x45\xdf\xa3", 0, "a Matroska/WebM media file"),
    (b"wOFF", 0, "a web font"),
    (b"wOF2", 0, "a web font"),
)


def sniff(data: bytes) -> str | None:
    """What the first bytes say the file is, or None for no known binary format."""
    for prefix, offset, what in _MAGIC:
        if data[offset:offset + len(prefix)] == prefix:
            return what
    if data[:4] == b"RIFF" and data[8:12] in (b"WAVE", b"AVI ", b"WEBP"):
        return "a RIFF media file (WAV, AVI or WebP)"
    if data[:3] == b"ID3" and data[3:4] in (b"\x02", b"\x03", b"\x04"):
        return "an MP3 audio file"
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return "UTF-16 text"
    return None


def declared_kind(filename: str, content_type: str) -> str:
    """"text" or "pdf", from the file's name (and the sender's content type when the name has no
    known suffix). A sender's content type that names some other kind of file is refused."""
    suffix = PurePosixPath(filename.lower()).suffix
    ctype = content_type.split(";", 1)[0].strip().lower()
    is_text_type = ctype.startswith("text/") or ctype in TEXT_TYPES
    if ctype not in NEUTRAL_TYPES and ctype not in PDF_TYPES and not is_text_type:
        raise refuse(f"the file was sent as {ctype[:60]}; only plain text, Markdown and PDF files are accepted",
                     "type")
    if suffix in TEXT_SUFFIXES:
        kind = "text"
    elif suffix in PDF_SUFFIXES:
        kind = "pdf"
    elif not suffix and is_text_type:
        kind = "text"
    elif not suffix and ctype in PDF_TYPES:
        kind = "pdf"
    else:
        raise refuse("only plain text (.txt), Markdown (.md) and PDF (.pdf) files are accepted", "type")
    if (kind == "text" and ctype in PDF_TYPES) or (kind == "pdf" and is_text_type):
        raise refuse(f"the file is named {suffix or 'without a suffix'} but was sent as {ctype}", "mismatch")
    return kind


def extract_text(filename: str, content_type: str, data: bytes) -> str:
    """The text of an upload, after checking it is what it claims to be. Raises a ValidationError
    on the `file` field for anything refused."""
    kind = declared_kind(filename, content_type)
    actual = sniff(data)
    if kind == "pdf":
        if b"%PDF-" not in data[:1024]:
            looks = "text" if actual is None and b"\x00" not in data[:4096] else (actual or "binary data")
            raise refuse(f"this file is named .pdf but is not a PDF (it is {looks})", "mismatch")
        return check_text(pdf_text(data), source="pdf")
    if actual is not None:
        hint = "; name it .pdf to index its text" if actual == "a PDF document" else ""
        if actual == "UTF-16 text":
            raise refuse("this file is UTF-16 text; save it as UTF-8", "encoding")
        raise refuse(f"this file is named like text but is {actual}{hint}", "mismatch")
    return check_text(decode_text(data), source="text")


def decode_text(data: bytes) -> str:
    if b"\x00" in data:
        raise refuse("this file contains NUL bytes: it is binary, not text", "binary")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise refuse(f"this file is not valid UTF-8 (byte {exc.start}); save it as UTF-8 text", "encoding") from None
    return text.removeprefix("\ufeff")


_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")
_SPACE = re.compile(r"\s+")
_WORDCHARS = re.compile(r"[^\W_]+")
# Each pattern runs in linear time: the run pattern only starts where a run starts.
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_RUN_CHARS + 1}}}")
_DEEP_QUOTE = re.compile(rf"^[ \t]*(?:>[ \t]*){{{MAX_NESTING + 1}}}", re.MULTILINE)
_DEEP_BRACKETS = re.compile(rf"[\[({{<]{{{MAX_NESTING + 1}}}")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _sliced(text: str) -> Iterator[str]:
    for i in range(0, len(text), _SLICE_CHARS):
        yield text[i:i + _SLICE_CHARS]


def _count(pattern: re.Pattern, text: str) -> int:
    """Characters matched by a pattern of one character class, slice by slice: re.sub over the
    whole text would build a list as long as the number of matches (100 MiB for 5 MiB of
    two-letter words)."""
    return sum(len(part) - len(pattern.sub("", part)) for part in _sliced(text))


def check_text(text: str, *, source: str) -> str:
    """Refuse text that is not prose: binary in disguise, symbol soup, pathological nesting or
    blobs without spaces. Text from a PDF is cleaned (control characters become spaces) rather
    than refused for them: a PDF's text layer often carries a few."""
    if source == "pdf":
        text = "".join(_SURROGATE.sub("\ufffd", _CONTROL.sub(" ", part)) for part in _sliced(text))
    else:
        controls = _count(_CONTROL, text)
        if controls > MAX_CONTROL_SHARE * len(text):
            raise refuse(f"{controls} of its {len(text)} characters are control characters: this is binary, not text",
                         "binary")
    visible = len(text) - _count(_SPACE, text)
    if not visible:
        raise refuse("no text found in this file" + (" (a scan? run OCR on it first)" if source == "pdf" else ""),
                     "no_text")
    if _DEEP_QUOTE.search(text):
        raise refuse(f"a line is nested more than {MAX_NESTING} blockquote levels deep", "nesting")
    if _DEEP_BRACKETS.search(text):
        raise refuse(f"the text opens more than {MAX_NESTING} brackets in a row", "nesting")
    if _LONG_RUN.search(text):
        raise refuse(f"the text has a run of more than {MAX_RUN_CHARS} characters without a space "
                     "(an embedded image or binary data?)", "long_run")
    word_chars = _count(_WORDCHARS, text)
    if word_chars < MIN_WORD_SHARE * visible:
        raise refuse(f"only {word_chars} of its {visible} visible characters are letters or digits: "
                     "this is not prose or Markdown", "not_prose")
    return text


# --- PDF --------------------------------------------------------------------------------


def _pdf_configuration():
    import pypdf

    return pypdf.apply_configuration(
        maximum_declared_stream_length=MAX_DOCUMENT_BYTES,
        array_based_stream_maximum_output_length=PDF_MAX_STREAM_BYTES,
        jbig2_maximum_output_length=PDF_MAX_STREAM_BYTES,
        lzw_maximum_output_length=PDF_MAX_STREAM_BYTES,
        run_length_maximum_output_length=PDF_MAX_STREAM_BYTES,
        zlib_maximum_output_length=PDF_MAX_STREAM_BYTES,
        zlib_maximum_recovery_input_length=MAX_DOCUMENT_BYTES,
        brotli_maximum_output_length=PDF_MAX_STREAM_BYTES,
        image_maximum_buffer_size=PDF_MAX_STREAM_BYTES,
        stream_decoding_work_maximum_length=4 * PDF_MAX_STREAM_BYTES,
        stream_parsing_work_maximum_count=PDF_MAX_STREAM_TOKENS,
        xfa_decoding_work_maximum_length=PDF_MAX_STREAM_BYTES,
        xmp_maximum_input_length=1024 * 1024,
        page_tree_maximum_entries=4 * PDF_MAX_PAGES,
        page_tree_maximum_page_entries=64 * PDF_MAX_PAGES,
        xform_maximum_invocations_per_extraction=PDF_MAX_FORM_CALLS,
        jbig2dec_binary=None,  # never run an external decoder on a tenant's file
        disable_legacy_handling=True,
    )


def _content_bytes(page) -> int:
    """Decoded bytes of a page's content streams plus those of each form XObject it draws, once
    per `Do` that names the form (at most PDF_MAX_FORM_CALLS times): the bytes text extraction
    will parse on this page. Forms drawn from inside forms are bounded by pypdf's own limit on
    form invocations per page instead."""
    from pypdf.generic import StreamObject

    contents = page.get_contents()
    data = contents.get_data() if contents is not None else b""
    total = len(data)
    resources = page.get("/Resources")
    resources = resources.get_object() if resources is not None else None
    xobjects = resources.get("/XObject") if isinstance(resources, dict) else None
    xobjects = xobjects.get_object() if xobjects is not None else None
    if isinstance(xobjects, dict):
        for name, ref in xobjects.items():
            form = ref.get_object()
            if isinstance(form, StreamObject) and form.get("/Subtype") == "/Form":
                calls = len(re.findall(re.escape(str(name).encode("latin-1", "replace")) + rb"\s*Do\b", data))
                total += len(form.get_data()) * max(1, min(calls, PDF_MAX_FORM_CALLS))
    return total


def pdf_text(data: bytes) -> str:
    """The text of a PDF, page by page, or a refusal that names the limit it hit."""
    import pypdf
    from pypdf.errors import FileNotDecryptedError, LimitReachedError, PyPdfError

    pages: list[str] = []
    total = content = 0
    with _pdf_configuration():
        try:
            reader = pypdf.PdfReader(io.BytesIO(data), strict=False)
            if reader.is_encrypted:
                raise refuse("this PDF is encrypted; remove its password and upload it again", "pdf_encrypted")
            count = len(reader.pages)
            if count > PDF_MAX_PAGES:
                raise refuse(f"this PDF has {count} pages; the limit is {PDF_MAX_PAGES}", "pdf_pages")
            for number, page in enumerate(reader.pages, start=1):
                content += _content_bytes(page)
                if content > PDF_MAX_CONTENT_BYTES:
                    raise refuse(f"this PDF has more than {PDF_MAX_CONTENT_BYTES // (1024 * 1024)} MiB of page content "
                                 f"(reached on page {number}); split it into smaller files", "pdf_too_much")
                text = page.extract_text() or ""
                if len(text) > PDF_MAX_PAGE_CHARS:
                    raise refuse(f"page {number} yields {len(text)} characters of text; "
                                 f"the limit is {PDF_MAX_PAGE_CHARS} per page", "pdf_too_much")
                total += len(text) + 2
                if total > PDF_MAX_TEXT_CHARS:
                    raise refuse(f"this PDF yields more than {PDF_MAX_TEXT_CHARS} characters of text "
                                 f"(reached on page {number}); split it into smaller files", "pdf_too_much")
                pages.append(text)
        except ValidationError:
            raise
        except FileNotDecryptedError:
            raise refuse("this PDF is encrypted; remove its password and upload it again", "pdf_encrypted") from None
        except LimitReachedError as exc:
            # a decompression bomb, a page-tree bomb, a content stream with too many operators
            raise refuse(f"this PDF goes beyond what the server reads from one file ({str(exc)[:160]})",
                         "pdf_too_much") from None
        except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError, AssertionError,
                RecursionError, OverflowError, ZeroDivisionError, UnicodeError, LookupError) as exc:
            # pypdf reports a damaged file with many exception types; the sender learns which.
            log.info("unreadable PDF upload: %s: %s", type(exc).__name__, str(exc)[:200])
            raise refuse(f"this PDF is damaged and cannot be read ({type(exc).__name__})", "pdf_broken") from None
    return "\n\n".join(pages)


# --- chunks -----------------------------------------------------------------------------

_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def _words(text: str) -> Iterator[list[str]]:
    """The words of `text` in order, in lists of at most a slice's worth (overlong words cut into
    pieces), with an empty list between paragraphs: str.split speed, bounded lists."""
    start = 0
    breaks = (brk.span() for brk in _PARAGRAPH_BREAK.finditer(text))
    for end, after in itertools.chain(breaks, [(len(text), len(text))]):
        while start < end:
            stop = min(end, start + _SLICE_CHARS)
            if stop < end:  # cut a slice at whitespace, so no word is split by the slicing
                space = max(text.rfind(" ", start, stop), text.rfind("\n", start, stop),
                            text.rfind("\t", start, stop))
                stop = space + 1 if space > start else stop
            words = text[start:stop].split()
            if any(len(w) > WORD_PIECE_CHARS for w in words):
                words = [w[i:i + WORD_PIECE_CHARS] for w in words for i in range(0, len(w), WORD_PIECE_CHARS)]
            if words:
                yield words
            start = stop
        start = after
        yield []


def iter_chunks(text: str, *, words: int = CHUNK_WORDS, overlap: int = CHUNK_OVERLAP,
                max_chars: int = CHUNK_MAX_CHARS) -> Iterator[str]:
    """Windows of at most `words` words and `max_chars` characters, the last `overlap` words
    (at most a quarter of `max_chars`) repeated in the next window; a paragraph that fits in a
    fresh window starts one instead of being split. Memory: one window, one paragraph head and
    one slice of words."""
    overlap = min(overlap, words // 2)
    small_words, small_chars, tail_chars = words - overlap, max_chars // 2, max_chars // 4
    items: list[str] = []
    width = 0  # characters of " ".join(items)
    fresh = 0  # items not yet part of an emitted chunk

    def close() -> str:
        nonlocal items, width, fresh
        chunk = " ".join(items)
        tail: list[str] = []
        tail_width = -1
        for word in reversed(items):
            if len(tail) >= overlap or tail_width + 1 + len(word) > tail_chars:
                break
            tail.append(word)
            tail_width += 1 + len(word)
        tail.reverse()
        items, width, fresh = tail, max(tail_width, 0), 0
        return chunk

    head: list[str] = []  # the start of the current paragraph while it may still be "small"
    head_chars = -1
    streaming = False  # the paragraph turned out large: its words go straight into windows
    for batch in _words(text):
        if not batch:  # end of a paragraph
            if head:
                if fresh and (len(items) + len(head) > words or width + 1 + head_chars > max_chars):
                    yield close()
                batch = head
            head, head_chars, streaming = [], -1, False
        elif not streaming:
            head.extend(batch)
            head_chars += sum(map(len, batch)) + len(batch)
            if len(head) <= small_words and head_chars <= small_chars:
                continue
            batch, head, head_chars, streaming = head, [], -1, True
        for word in batch:
            if fresh and width + 1 + len(word) > max_chars:
                yield close()
            width += len(word) + (1 if items else 0)
            items.append(word)
            fresh += 1
            if len(items) >= words:
                yield close()
    if fresh:
        yield close()


def chunk_text(text: str, **kwargs) -> list[str]:
    return list(iter_chunks(text, **kwargs))


_FILENAME_JUNK = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def clean_label(value: str, limit: int) -> str:
    """A file name or content type fit to store and show: no control characters, bounded."""
    return _FILENAME_JUNK.sub("", value)[:limit].strip()
