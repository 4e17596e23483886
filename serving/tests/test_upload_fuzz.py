"""Knowledge-base uploads fed bad input: every refusal has a reason, nothing is half-saved, and
the memory an upload costs is bounded by the size limit, not by what the sender sends.

The cases are the ones a tenant's member (or a script with their session) can send: files too
large, of the wrong type, lying about their type by name or content type (a .txt that is a PNG,
ZIP, ELF or PDF; a .pdf that is text), invalid UTF-8, NUL bytes, control characters, 100,000
levels of Markdown nesting, a 10 MB single line, PDFs that are encrypted, damaged, too long,
decompression bombs and page-tree bombs. Each is checked at the service (the reason's code) and
through the page (the reason on the form's file field, status 400), with the row counts of
Document, Chunk and the upload audit event unchanged. The hypothesis part throws generated
bytes, names and content types at the service and damaged PDFs at the extractor.

Memory is measured with tracemalloc around the whole request (middleware, multipart parsing,
the view, the service, the database writes), with the request body streamed from a file on
disk, so the figure is what the server allocates. No test here measures time.

There is no upload endpoint in the JSON API (api/): uploads go through the page only.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import tracemalloc
import zlib

import pytest
from django.core.exceptions import ValidationError
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.test.client import ClientHandler
from django.urls import reverse
from django.utils.html import escape
from hypothesis import HealthCheck, assume, example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from portal.models import AuditEvent
from serving import ingest
from serving import services as svc
from serving.models import Chunk, Document
from serving.tests.pdfs import make_pdf, nested_arrays, page_tree_bomb, text_content

LIMIT = ingest.MAX_DOCUMENT_BYTES
MiB = 1024 * 1024
FUZZING = hsettings.get_current_profile_name() == "fuzz"  # make fuzz: bigger budgets (conftest.py)


def examples(n: int) -> int:
    return max(n, hsettings.default.max_examples) if FUZZING else n


@pytest.fixture
def kb(org):
    admin = org.people["alpha"]["admin"]
    return svc.create_knowledge_base(admin, tenant=org.tenants["alpha"], slug="uploads", name="Uploads",
                                     projects=[org.projects["alpha"]])


@pytest.fixture
def uploader(org):
    return org.people["alpha"]["user"]


def saved() -> tuple[int, int, int]:
    # a refusal by permission is audited (outcome "denied"); only a stored document has a success
    return (Document.objects.count(), Chunk.objects.count(),
            AuditEvent.objects.filter(action="kb.document.upload", outcome="success").count())


def refusal_code(exc: ValidationError) -> str:
    return exc.error_dict["file"][0].code


PROSE = b"# Handbook\n\nThe quarterly GPU review meets on Tuesdays.\n\nBring the usage report.\n"
PDF_TEXT = make_pdf(["Quarterly GPU review", "Bring the usage report"])

# (id, file name, content type, bytes, refusal code)
BAD = [
    ("oversized", "big.txt", "text/plain", b"word " * (LIMIT // 5 + 1), "too_large"),
    ("single-10MB-line", "line.txt", "text/plain", b"x" * (10 * MiB), "too_large"),
    ("empty", "empty.txt", "text/plain", b"", "empty"),
    ("exe-name", "setup.exe", "application/octet-stream", b"MZ\x90\x00" + b"\x00" * 60, "type"),
    ("docx-name", "notes.docx", "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
     b"PK\x03\x04" + b"\x00" * 30, "type"),
    ("png-content-type", "notes.txt", "image/png", PROSE, "type"),
    ("no-suffix-binary-type", "README", "application/zip", PROSE, "type"),
    ("txt-named-but-sent-as-pdf", "notes.txt", "application/pdf", PROSE, "mismatch"),
    ("png-as-txt", "notes.txt", "text/plain", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + b"\x00" * 40, "mismatch"),
    ("zip-as-md", "notes.md", "text/markdown", b"PK\x03\x04\x14\x00\x00\x00" + b"A" * 40, "mismatch"),
    ("elf-as-txt", "notes.txt", "text/plain", b"\x7fELF\x02\x01\x01" + b"\x00" * 40, "mismatch"),
    ("gzip-as-md", "notes.md", "", zlib.compress(PROSE, wbits=31), "mismatch"),
    ("pdf-as-txt", "notes.txt", "text/plain", PDF_TEXT, "mismatch"),
    ("pdf-as-md-octet", "notes.md", "application/octet-stream", PDF_TEXT, "mismatch"),
    ("text-as-pdf", "report.pdf", "application/pdf", PROSE, "mismatch"),
    ("png-as-pdf", "report.pdf", "application/pdf", b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "mismatch"),
    ("latin-1", "notes.txt", "text/plain", "Caf\xe9 cr\xe8me, na\xefve r\xe9sum\xe9".encode("latin-1"), "encoding"),
    ("truncated-utf8", "notes.txt", "text/plain", "Grüße".encode()[:-4] + b"\xc3", "encoding"),
    ("utf-16", "notes.txt", "text/plain", "Quarterly GPU review".encode("utf-16"), "encoding"),
    ("nul-bytes", "notes.txt", "text/plain", PROSE + b"\x00" + PROSE, "binary"),
    ("control-characters", "notes.txt", "text/plain", bytes(range(1, 9)) * 20 + PROSE, "binary"),
    ("random-binary", "notes.txt", "text/plain", bytes((i * 7919 + 13) % 251 + 1 for i in range(4096)), "encoding"),
    ("deep-blockquote", "deep.md", "text/markdown", b"> " * 100_000 + b"deep thought\n", "nesting"),
    ("deep-blockquote-tight", "deep.md", "text/markdown", b">" * 100_000 + b" deep thought\n", "nesting"),
    ("deep-links", "deep.md", "text/markdown", b"[" * 100_000 + b"x" + b"](y)" * 100_000, "nesting"),
    ("deep-emphasis", "deep.md", "text/markdown", b"*" * 10_000 + b" word " + b"*" * 10_000, "not_prose"),
    ("4MB-line-no-spaces", "line.txt", "text/plain", b"QUJD" * MiB, "long_run"),
    ("only-whitespace", "blank.md", "text/markdown", b" \n\t\n" * 1000, "no_text"),
    ("symbol-soup", "soup.md", "text/markdown", b"-=+*#|~^ " * 20_000, "not_prose"),
    ("pdf-encrypted", "secret.pdf", "application/pdf", make_pdf(["Quarterly GPU review"], password="s3cret"),
     "pdf_encrypted"),
    ("pdf-truncated", "cut.pdf", "application/pdf", PDF_TEXT[: len(PDF_TEXT) // 2], "pdf_broken"),
    ("pdf-garbage", "junk.pdf", "application/pdf", b"%PDF-1.7\n" + b"\x00garbage" * 200, "pdf_broken"),
    ("pdf-nested-arrays", "deep.pdf", "application/pdf", nested_arrays(100_000), "pdf_broken"),
    ("pdf-no-text", "scan.pdf", "application/pdf", make_pdf(["", "", ""]), "no_text"),
    ("pdf-too-many-pages", "book.pdf", "application/pdf", make_pdf([""] * (ingest.PDF_MAX_PAGES + 1)), "pdf_pages"),
    ("pdf-page-tree-bomb", "tree.pdf", "application/pdf", page_tree_bomb(200_000), "pdf_too_much"),
    ("pdf-deflate-bomb", "bomb.pdf", "application/pdf", make_pdf(["x"], contents=b"0 " * (40 * MiB)), "pdf_too_much"),
    ("pdf-content-over-budget", "busy.pdf", "application/pdf",
     make_pdf(["x"], contents=b"0 0 m 612 792 l S\n" * (ingest.PDF_MAX_CONTENT_BYTES // 18 + 1)), "pdf_too_much"),
    ("pdf-form-drawn-too-often", "forms.pdf", "application/pdf",
     make_pdf(["cover"], form=b"0 0 m 1 1 l S\n" * 20_000, form_calls=ingest.PDF_MAX_FORM_CALLS), "pdf_too_much"),
    ("pdf-page-too-much-text", "dense.pdf", "application/pdf", make_pdf(["word " * 25_000]), "pdf_too_much"),
]


# One test walks every case (the two-tenant organisation is built once, not 40 times); a
# failure names each case that went wrong.


def test_the_service_refuses_bad_files_with_a_reason_and_saves_nothing(kb, uploader):
    wrong = []
    for case, name, ctype, data, code in BAD:
        before = saved()
        try:
            svc.upload_document(uploader, kb, filename=name, content_type=ctype, data=data)
        except ValidationError as exc:
            if refusal_code(exc) != code or not exc.messages[0]:
                wrong.append(f"{case}: refused as {refusal_code(exc)} ({exc.messages}), expected {code}")
        else:
            wrong.append(f"{case}: accepted, expected {code}")
        if saved() != before:
            wrong.append(f"{case}: rows changed {before} -> {saved()}")
    assert not wrong, "\n".join(wrong)


def test_the_page_shows_the_reason_on_the_file_field_and_saves_nothing(kb, uploader, client):
    client.force_login(uploader)
    wrong = []
    for case, name, ctype, data, _ in BAD:
        before = saved()
        response = client.post(reverse("serving:kb_upload", args=[kb.pk]),
                               {"file": SimpleUploadedFile(name, data, content_type=ctype)})
        errors = response.context["upload"].errors.get("file", []) if response.context else []
        if response.status_code != 400 or len(errors) != 1 or escape(errors[0]) not in response.content.decode():
            wrong.append(f"{case}: answered {response.status_code} with file errors {errors}")
        if saved() != before:
            wrong.append(f"{case}: rows changed {before} -> {saved()}")
    assert not wrong, "\n".join(wrong)


def test_a_good_text_markdown_and_pdf_upload_are_indexed_and_searchable(kb, uploader, client):
    client.force_login(uploader)
    url = reverse("serving:kb_upload", args=[kb.pk])
    files = [("notes.txt", "text/plain", b"\xef\xbb\xbfThe zorblax quota is reviewed monthly."),
             ("notes.md", "", PROSE.replace(b"Tuesdays", b"Tuesdays in the quuxroom")),
             ("review.pdf", "application/pdf", make_pdf(["The frobnicator needs approval", "Second page"]))]
    for name, ctype, data in files:
        response = client.post(url, {"file": SimpleUploadedFile(name, data, content_type=ctype)})
        assert response.status_code == 302, response.content[:500]
    assert Document.objects.filter(knowledge_base=kb).count() == 3
    assert AuditEvent.objects.filter(action="kb.document.upload").count() == 3
    for word in ("zorblax", "quuxroom", "frobnicator"):
        hits = svc.search_for_user(uploader, kb, word)
        assert len(hits) == 1 and word in hits[0].text


def test_the_upload_still_needs_the_csrf_token(kb, uploader):
    # the view is csrf_exempt only so that its upload handler is installed first; it checks itself
    client = Client(enforce_csrf_checks=True)
    client.force_login(uploader)
    response = client.post(reverse("serving:kb_upload", args=[kb.pk]),
                           {"file": SimpleUploadedFile("notes.md", PROSE, content_type="text/markdown")})
    assert response.status_code == 403
    assert saved() == (0, 0, 0)


def test_a_reader_of_a_base_cannot_upload_into_it(org, kb, client):
    # platform read access sees every tenant's bases (the page answers 200) but may not write
    client.force_login(org.admin)
    assert client.get(reverse("serving:kb_detail", args=[kb.pk])).status_code == 200
    response = client.post(reverse("serving:kb_upload", args=[kb.pk]),
                           {"file": SimpleUploadedFile("notes.md", PROSE, content_type="text/markdown")})
    assert response.status_code == 403
    assert saved() == (0, 0, 0)


def test_a_refusal_leaves_nothing_behind_even_when_the_database_fails_mid_write(kb, uploader, monkeypatch):
    # the search-vector update fails after the document and its chunks were inserted: all or nothing
    from django.db import DatabaseError
    from django.db.models import QuerySet

    real_update = QuerySet.update

    def failing_update(self, **kwargs):
        if "search_vector" in kwargs:
            raise DatabaseError("disk full")
        return real_update(self, **kwargs)

    monkeypatch.setattr(QuerySet, "update", failing_update)
    with pytest.raises(DatabaseError):
        svc.upload_document(uploader, kb, filename="notes.md", content_type="text/markdown", data=PROSE * 50)
    assert saved() == (0, 0, 0)


# --- bounded reading and bounded memory ---------------------------------------------------------


class EndlessUpload(io.RawIOBase):
    """A file that never ends, counting what is read from it."""

    def __init__(self):
        self.read_bytes = 0

    def readable(self):
        return True

    def readinto(self, buffer):
        n = len(buffer)
        buffer[:n] = b"a " * (n // 2) + b"a" * (n % 2)
        self.read_bytes += n
        return n


def test_the_service_reads_at_most_the_limit_plus_one_byte(kb, uploader):
    endless = EndlessUpload()
    with pytest.raises(ValidationError) as caught:
        svc.upload_document(uploader, kb, filename="endless.txt", content_type="text/plain", data=endless)
    assert refusal_code(caught.value) == "too_large"
    assert endless.read_bytes == LIMIT + 1
    assert saved() == (0, 0, 0)


def _multipart_on_disk(directory: str, name: str, ctype: str, size: int, pattern: bytes) -> tuple[str, str, int]:
    """A multipart/form-data body with one file field of `size` bytes, written to disk in pieces so
    the test itself never holds it in memory."""
    boundary = "atrium-upload-boundary-7f3a"
    path = os.path.join(directory, "body")
    with open(path, "wb") as out:
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
                  f"Content-Type: {ctype}\r\n\r\n".encode())
        piece = pattern * (MiB // len(pattern))
        left = size
        while left:
            out.write(piece[:left])
            left -= min(left, len(piece))
        out.write(f"\r\n--{boundary}--\r\n".encode())
    return path, boundary, os.path.getsize(path)


def _post_from_disk(client, url: str, path: str, boundary: str, length: int):
    """POST a body from disk through the test client's own handler (every middleware, the real
    multipart parser), the way a WSGI server hands it over; returns (response, peak bytes)."""
    cookies = "; ".join(f"{k}={m.value}" for k, m in client.cookies.items())
    with open(path, "rb") as body:
        environ = {
            "REQUEST_METHOD": "POST", "PATH_INFO": url, "QUERY_STRING": "", "SCRIPT_NAME": "",
            "SERVER_NAME": "testserver", "SERVER_PORT": "80", "SERVER_PROTOCOL": "HTTP/1.1",
            "HTTP_HOST": "testserver", "REMOTE_ADDR": "127.0.0.1", "HTTP_COOKIE": cookies,
            "CONTENT_TYPE": f"multipart/form-data; boundary={boundary}", "CONTENT_LENGTH": str(length),
            "wsgi.input": body, "wsgi.errors": sys.stderr, "wsgi.url_scheme": "http", "wsgi.version": (1, 0),
            "wsgi.multithread": False, "wsgi.multiprocess": False, "wsgi.run_once": False,
        }
        handler = ClientHandler(enforce_csrf_checks=False)
        tracemalloc.start()
        try:
            response = handler(environ)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    return response, peak


@pytest.fixture
def recorded_handlers(monkeypatch):
    """The real BoundedUploadHandler, remembering its instances so the test can read its counters."""
    made = []

    class Recording(ingest.BoundedUploadHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(ingest, "BoundedUploadHandler", Recording)
    return made


def test_a_20_mib_upload_keeps_at_most_the_limit_plus_one_byte_in_memory(kb, uploader, client, recorded_handlers):
    client.force_login(uploader)
    size = 20 * MiB
    with tempfile.TemporaryDirectory() as tmp:
        path, boundary, length = _multipart_on_disk(tmp, "huge.txt", "text/plain", size, b"word ")
        response, peak = _post_from_disk(client, reverse("serving:kb_upload", args=[kb.pk]), path, boundary, length)
    assert response.status_code == 400
    assert b"files are limited to 5 MiB" in response.content
    [handler] = recorded_handlers
    assert handler.received == size  # the whole body went past it...
    assert handler.kept == LIMIT + 1  # ...and it kept one byte more than allowed
    # the kept bytes (handed to the service without a copy) and the page answered with the reason
    assert peak < 2.5 * LIMIT, f"peak {peak / MiB:.1f} MiB for a {size // MiB} MiB upload"
    print(f"\n20 MiB refused upload: tracemalloc peak {peak / MiB:.1f} MiB ({peak / LIMIT:.2f} x the limit)")
    assert saved() == (0, 0, 0)


@pytest.mark.slow
def test_the_largest_accepted_text_costs_a_bounded_multiple_of_the_limit(kb, uploader, client):
    # the worst accepted text for memory: as many words (and so chunks) as the limit allows, and a
    # character beyond Latin-1 so Python holds the text at two bytes a character
    pattern = "ab 東 ".encode()
    client.force_login(uploader)
    with tempfile.TemporaryDirectory() as tmp:
        path, boundary, length = _multipart_on_disk(tmp, "words.txt", "text/plain", LIMIT, pattern)
        response, peak = _post_from_disk(client, reverse("serving:kb_upload", args=[kb.pk]), path, boundary, length)
    assert response.status_code == 302, response.content[:500]
    doc = Document.objects.get(knowledge_base=kb)
    assert doc.size <= LIMIT and doc.chunk_count == Chunk.objects.filter(document=doc).count() > 1000
    print(f"\naccepted {LIMIT // MiB} MiB text ({pattern!r}, {doc.chunk_count} chunks): "
          f"tracemalloc peak {peak / MiB:.1f} MiB ({peak / LIMIT:.2f} x the limit)")
    assert peak < 8 * LIMIT, f"peak {peak / MiB:.1f} MiB"


@pytest.mark.slow
@pytest.mark.parametrize("data", [make_pdf(["x"], contents=b"0 " * (40 * MiB)), page_tree_bomb(200_000)],
                         ids=["deflate-bomb", "page-tree-bomb"])
def test_a_pdf_bomb_is_refused_within_a_bounded_multiple_of_the_limit(kb, uploader, client, data):
    client.force_login(uploader)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "body")
        boundary = "atrium-upload-boundary-7f3a"
        with open(path, "wb") as out:
            out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="b.pdf"\r\n'
                      "Content-Type: application/pdf\r\n\r\n".encode() + data + f"\r\n--{boundary}--\r\n".encode())
        response, peak = _post_from_disk(client, reverse("serving:kb_upload", args=[kb.pk]), path, boundary,
                                         os.path.getsize(path))
    assert response.status_code == 400 and b"goes beyond what the server reads" in response.content
    print(f"\nPDF bomb of {len(data)} bytes refused: tracemalloc peak {peak / MiB:.1f} MiB "
          f"({peak / LIMIT:.2f} x the limit)")
    assert peak < 8 * LIMIT, f"peak {peak / MiB:.1f} MiB"
    assert saved() == (0, 0, 0)


# --- generated input ----------------------------------------------------------------------------

CODES = {"too_large", "empty", "type", "mismatch", "encoding", "binary", "nesting", "long_run", "not_prose",
         "no_text", "pdf_encrypted", "pdf_broken", "pdf_pages", "pdf_too_much", None}
MAGIC = [prefix for prefix, offset, _ in ingest._MAGIC if offset == 0]
NAMES = st.one_of(
    st.sampled_from(["notes.txt", "notes.md", "README.markdown", "paper.pdf", "NOTES.TXT", "a.PDF", "x.text",
                     "archive.zip", "photo.png", "run.sh", "noext", ".md", "a.b.c.md", "", "ünïcødé.md"]),
    st.text(min_size=0, max_size=40),
    st.text(min_size=1, max_size=20).map(lambda s: s + ".md"),
)
CONTENT_TYPES = st.one_of(
    st.sampled_from(["", "text/plain", "text/markdown", "text/x-markdown", "application/pdf",
                     "application/octet-stream", "image/png", "application/zip", "text/plain; charset=utf-8",
                     "TEXT/PLAIN", "application/x-pdf", "multipart/mixed"]),
    st.text(max_size=30),
)
TEXTS = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=3000)
CONTENTS = st.one_of(
    TEXTS.map(lambda t: t.encode("utf-8")),  # any Unicode text, as UTF-8
    st.binary(max_size=3000),  # any bytes
    st.tuples(st.sampled_from(MAGIC), st.binary(max_size=500)).map(lambda t: t[0] + t[1]),  # a lying file
    st.tuples(TEXTS, st.sampled_from(["latin-1", "utf-16", "utf-32", "cp1252"]))
    .map(lambda t: t[0].encode(t[1], "replace")),  # right text, wrong encoding
    st.tuples(st.sampled_from(["> ", "[", "(", "*", "- ", "    "]), st.integers(1, 5000), TEXTS)
    .map(lambda t: (t[0] * t[1] + t[2]).encode()),  # nesting of any depth
    st.lists(st.sampled_from(["Quarterly", "GPU", "review", "naïve", "東京", "\n\n", "\t", "x" * 600]),
             max_size=400).map(lambda w: " ".join(w).encode()),  # plausible prose, some overlong words
)


@hsettings(max_examples=examples(60), deadline=None, database=None, derandomize=not FUZZING,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                  HealthCheck.data_too_large])
@given(name=NAMES, ctype=CONTENT_TYPES, data=CONTENTS)
@example(name="a.md", ctype="text/markdown", data=b"\xef\xbb\xbf# Title\n\nbody")
@example(name="a.txt", ctype="text/plain", data=("x" * 600 + " ") * 100)
@example(name="a\x00b.md", ctype="text/markdown\x00", data=b"file names with NUL are cleaned")
def test_any_bytes_under_any_name_are_indexed_or_refused_with_a_reason(kb, uploader, name, ctype, data):
    data = data.encode() if isinstance(data, str) else data
    before = saved()
    try:
        doc = svc.upload_document(uploader, kb, filename=name, content_type=ctype, data=data)
    except ValidationError as exc:
        code = refusal_code(exc) if hasattr(exc, "error_dict") else None
        assert code in CODES, (code, exc.messages)
        assert exc.messages and all(exc.messages)
        assert saved() == before
        return
    chunks = list(Chunk.objects.filter(document=doc).order_by("ordinal").values_list("text", flat=True))
    assert doc.chunk_count == len(chunks) > 0
    assert saved() == (before[0] + 1, before[1] + len(chunks), before[2] + 1)
    assert all(0 < len(c) <= ingest.CHUNK_MAX_CHARS for c in chunks)
    assert "\x00" not in doc.title and len(doc.title) <= 200


SEPARATORS = [" ", "\n", "\n\n", "\t\n \n", "  \n", "\r\n\r\n"]


@st.composite
def unique_words(draw) -> str:
    """Text whose every word, and every piece of an overlong word, is distinct: so the overlap
    between two chunks can be told from a repeated word."""
    kinds = draw(st.lists(st.tuples(st.sampled_from(["short", "long", "unicode"]), st.sampled_from(SEPARATORS)),
                          max_size=1500))
    words = {"short": "w{i}", "unicode": "東{i}ßé"}
    return "".join(("".join(f"{i}.{j}," for j in range(150)) if kind == "long" else words[kind].format(i=i)) + sep
                   for i, (kind, sep) in enumerate(kinds))


def _pieces(text: str) -> list[str]:
    return [w[i:i + ingest.WORD_PIECE_CHARS] for w in text.split() for i in range(0, len(w), ingest.WORD_PIECE_CHARS)]


@hsettings(max_examples=examples(150), deadline=None, derandomize=not FUZZING, database=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20_000)
       | st.lists(st.sampled_from(["w", "word", "x" * 700, "\n\n", "\n", " ", "\t\n \n"]), max_size=3000).map("".join),
       words=st.integers(2, 200), max_chars=st.integers(1000, 6000))
def test_chunks_without_overlap_are_the_words_in_order_within_their_bounds(text, words, max_chars):
    chunks = ingest.chunk_text(text, words=words, overlap=0, max_chars=max_chars)
    assert all(len(c.split()) <= words and 0 < len(c) <= max_chars for c in chunks)
    assert [w for c in chunks for w in c.split()] == _pieces(text)


@hsettings(max_examples=examples(150), deadline=None, derandomize=not FUZZING, database=None)
@given(text=unique_words(), words=st.integers(2, 200), overlap=st.integers(0, 60), max_chars=st.integers(1000, 6000))
def test_chunks_overlap_by_at_most_their_overlap_and_lose_no_word(text, words, overlap, max_chars):
    chunks = ingest.chunk_text(text, words=words, overlap=overlap, max_chars=max_chars)
    assert all(len(c.split()) <= words and 0 < len(c) <= max_chars for c in chunks)
    rebuilt: list[str] = []
    for c in chunks:
        got = c.split()
        shared = 0 if not rebuilt or got[0] not in rebuilt else len(rebuilt) - rebuilt.index(got[0])
        assert shared <= min(overlap, words // 2) and rebuilt[len(rebuilt) - shared:] == got[:shared]
        assert len(got) > shared  # every chunk brings new words
        rebuilt.extend(got[shared:])
    assert rebuilt == _pieces(text)


@hsettings(max_examples=examples(25), deadline=None, derandomize=not FUZZING, database=None)
@given(pages=st.lists(st.lists(st.from_regex(r"[A-Za-z0-9]{1,12}", fullmatch=True), min_size=1, max_size=40)
                      .map(" ".join), min_size=1, max_size=6))
def test_the_text_of_a_generated_pdf_comes_back_word_for_word(pages):
    text = ingest.extract_text("doc.pdf", "application/pdf", make_pdf(pages))
    assert text.split() == " ".join(pages).split()


def _damage(pdf: bytes, cuts: list[tuple[int, int, bytes]]) -> bytes:
    data = bytearray(pdf)
    for at, length, junk in cuts:
        at %= len(data)
        data[at:at + length] = junk
    return bytes(data)


@hsettings(max_examples=examples(80), deadline=None, derandomize=not FUZZING, database=None)
@given(cuts=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 64),
                               st.binary(max_size=16) | st.sampled_from([b"[[[[[[[[", b"<<<<", b"9999999999 0 R",
                                                                         b"/Length 99999999", b"stream", b"%%EOF"])),
                     min_size=1, max_size=6))
@example(cuts=[(10, 0, b"")])
def test_a_damaged_pdf_is_read_or_refused_never_a_crash(cuts):
    pdf = make_pdf(["Quarterly GPU review", "Bring the usage report"], form=text_content("in a form"), form_calls=1)
    damaged = _damage(pdf, cuts)
    assume(damaged[:5] == b"%PDF-")
    try:
        text = ingest.extract_text("doc.pdf", "application/pdf", damaged)
    except ValidationError as exc:
        assert refusal_code(exc) in {"pdf_broken", "pdf_too_much", "pdf_encrypted", "pdf_pages", "no_text",
                                     "nesting", "long_run", "not_prose", "mismatch"}, exc.messages
    else:
        assert "\x00" not in text and text.strip()
