"""``config.properties`` and TorchServe config snapshots against an independent reader.

Our reader (server/ts_config.py) and snapshot writer (server/ts_snapshot.py) are compared with
the ``javaproperties`` library, a separate implementation of ``java.util.Properties``, on
generated files and on a table of tricky ones; where a JDK is installed, with
``java.util.Properties`` itself. javaproperties departs from the JDK (9 and later, what TorchServe
runs on) in one corner: a line of a lone backslash, continued or at the end of the file. There
the JDK is followed, the generated cases leave that corner out, and the table says what each
reader gives.
"""

from __future__ import annotations

import io
import json
import random
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import javaproperties
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from server.errors import ConfigError
from server.ts_config import parse_properties, read_properties
from server.ts_snapshot import properties_text

WHERE = Path("c.properties")

# Pieces a generated file is made of: the characters that mean something to the format,
# escapes good and bad, line ends of the three kinds, and text beyond ASCII.
PIECES = [
    "a", "k", "u", "0", "F", " ", "\t", "\f", "=", ":", "#", "!", "\\", "\\", "\n", "\r", "\r\n",
    "\\u0041", "\\u00e9", "\\uD83D", "\\uDE00", "\\u12", "\\uzzzz", "\\n", "\\t", "\\ ", "\\=",
    "\\:", "\\\\", "\\q", "é", "€", "😀", "\x00", "\x0b", "\x85", "\u2028",
]  # fmt: skip
property_texts = st.lists(
    st.sampled_from(PIECES) | st.characters(blacklist_categories=("Cs",)), max_size=60
).map("".join)


def ours(text: str) -> dict[str, str] | str:
    try:
        return {k: p.value for k, p in parse_properties(text, WHERE).items()}
    except ConfigError:
        return "malformed"


def oracle(text: str) -> dict[str, str] | str:
    try:
        return dict(javaproperties.loads(text))
    except javaproperties.InvalidUEscapeError:
        return "malformed"


def lone_backslash_line(text: str) -> bool:
    """The corner where javaproperties and the JDK part (see the module's docstring)."""
    return any(line.lstrip(" \t\f") == "\\" for line in re.split(r"\r\n|\r|\n", text))


# (file, what the JDK reads, what javaproperties reads where it differs)
TRICKY: list[tuple[str, dict[str, str] | str, dict[str, str] | None]] = [
    (
        "a=1\nb : 2\nc 3\nd\t=\t4\ne\f:\f5\nf\n",
        {"a": "1", "b": "2", "c": "3", "d": "4", "e": "5", "f": ""},
        None,
    ),
    ("a = b = c\nd:=e\nf =:g\n", {"a": "b = c", "d": "=e", "f": ":g"}, None),
    ("  # comment\n\t! also one\n\f#x=1\n#a\\\nb=2\n", {"b": "2"}, None),
    (
        "key\\ with\\ spaces=v\nk\\=e\\:y\\#\\!=w\n\\ lead=x\n",
        {"key with spaces": "v", "k=e:y#!": "w", " lead": "x"},
        None,
    ),
    ('a=\\u00e9\\u20AC\\t\\n\\r\\f\\\\\\q\\"', {"a": 'é€\t\n\r\f\\q"'}, None),
    ("a\\u0020b=c", {"a b": "c"}, None),  # an escaped space does not end the key
    ("pair=\\uD83D\\uDE00\nlone=\\uD800x\n", {"pair": "😀", "lone": "\ud800x"}, None),
    ("a=x\\\n    y\\\n\tz\n", {"a": "xyz"}, None),  # continuation lines lose their indent
    ("a=x\\\r\n  y\r\nb=x\\\r  y\rc=3", {"a": "xy", "b": "xy", "c": "3"}, None),
    ("a=\\\\\nb=\\\\\\\nc\n", {"a": "\\", "b": "\\c"}, None),  # even: no continuation
    ("a=b\\\n# not a comment\n", {"a": "b# not a comment"}, None),
    ("a=b\\\n\n c=d\n", {"a": "b", "c": "d"}, None),  # a blank line ends a continued one
    ("a=1\\", {"a": "1"}, None),  # the end of the file drops the last backslash
    ("a=\nb:\nc\n  d  \n", {"a": "", "b": "", "c": "", "d": ""}, None),
    ("a=1\na=2\n", {"a": "2"}, None),
    ("=v\n:w\n", {"": "w"}, None),
    ("a=b  \n", {"a": "b  "}, None),  # a value keeps its trailing spaces
    ("ключ=значение\n", {"ключ": "значение"}, None),
    ("a\x00b=\x0b\x85\u2028\n", {"a\x00b": "\x0b\x85\u2028"}, None),  # no line ends, no blanks
    ("a=1\nb=\\u12\n", "malformed", None),
    ("b=\\uzzzz", "malformed", None),
    ("#\\u12\nb=1", {"b": "1"}, None),  # comments are not unescaped
    # A lone backslash: the JDK reads the next line as a new one (blank: skipped, # or !: a
    # comment), and at the end of the file a line of it, unless a CRLF ends it, is the key "".
    ("\\\n#c\nk=v\n", {"k": "v"}, {"#c": "", "k": "v"}),
    ("  \\\n  \\\n!c\n k=v", {"k": "v"}, {"!c": "", "k": "v"}),
    ("\\\n\nk=v", {"k": "v"}, None),
    ("\\", {"": ""}, {}),
    ("a=1\n\\\n", {"a": "1", "": ""}, {"a": "1"}),
    ("a=1\n\\\r", {"a": "1", "": ""}, {"a": "1"}),
    ("a=1\n\\\r\n", {"a": "1"}, None),
]


@pytest.mark.parametrize(("text", "jdk", "other"), TRICKY)
def test_tricky_files_read_as_java_reads_them(
    text: str, jdk: dict[str, str] | str, other: dict[str, str] | None
) -> None:
    assert ours(text) == jdk
    assert oracle(text) == (jdk if other is None else other)


def test_a_bad_escape_names_file_and_line_of_its_logical_line() -> None:
    with pytest.raises(ConfigError, match=r"^c.properties line 3: malformed \\uxxxx escape"):
        parse_properties("a=1\n\nb=x\\\n  \\u12\n", WHERE)


@settings(max_examples=300, deadline=None)
@given(property_texts)
def test_generated_files_read_as_javaproperties_reads_them(text: str) -> None:
    assume(not lone_backslash_line(text))
    assert ours(text) == oracle(text)


def oracle_bytes(data: bytes) -> dict[str, str] | str:
    try:
        return dict(javaproperties.load(io.BytesIO(data)))  # bytes: ISO-8859-1, as Java's
    except javaproperties.InvalidUEscapeError:
        return "malformed"


@settings(max_examples=100, deadline=None)
@given(st.lists(property_texts.map(str.encode) | st.binary(max_size=3), max_size=8).map(b"".join))
def test_files_as_bytes_utf8_else_iso_8859_1(
    tmp_path_factory: pytest.TempPathFactory, data: bytes
) -> None:
    """As Java 9+ reads a properties resource: UTF-8, or ISO-8859-1 when the file is not."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
        expected = oracle_bytes(data)
    else:
        expected = oracle(text)
    assume(not lone_backslash_line(text))
    path = tmp_path_factory.getbasetemp() / "generated.properties"
    path.write_bytes(data)
    try:
        found: dict[str, str] | str = {k: p.value for k, p in read_properties(path).items()}
    except ConfigError:
        found = "malformed"
    assert found == expected


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"a=\xc3\xa9", {"a": "é"}),  # UTF-8
        (b"a=\xe9", {"a": "é"}),  # not UTF-8: ISO-8859-1
        (b"a=\xe9\nb=\xc3\xa9", {"a": "é", "b": "Ã©"}),  # one such byte decides for the file
        (b"a=\\u00e9", {"a": "é"}),
    ],
)
def test_utf8_else_iso_8859_1(tmp_path: Path, data: bytes, expected: dict[str, str]) -> None:
    path = tmp_path / "config.properties"
    path.write_bytes(data)
    assert {k: p.value for k, p in read_properties(path).items()} == expected


# --- the snapshot writer -------------------------------------------------------------------

WRITTEN = [
    ("key with spaces", "value with spaces"),
    (" leading", "  two leading spaces"),
    ("k=e:y#!", "v=a:l#u!e"),
    ("#looks like a comment", "!so does this"),
    ("!bang", "#hash"),
    ("back\\slash\\", "C:\\path\\to\\x\\"),
    ("é", "ünïcødé €"),
    ("emoji😀", "😀 and a lone half \ud83d"),
    ("lines", "one\ntwo\r\nthree\rfour\n"),
    ("tabs\t", "\tlead\tand\f"),
    ("", "an empty key"),
    ("empty value", ""),
    ("trailing", "spaces  "),
    ("control", "\x00\x01\x1f\x7f\x85"),
    (
        "model_snapshot",
        json.dumps(
            {"name": "s.cfg", "models": {"m é": {"1.0": {"marName": "m.mar"}}}},
            indent=2,
            ensure_ascii=False,
        ),
    ),
]


def assert_reads_back(items: list[tuple[str, str]]) -> str:
    """What a snapshot holds reads back unchanged: by javaproperties (as text, and as bytes the
    way TorchServe's ``Properties.load`` reads them) and by our own reader."""
    text = properties_text(items, 0.0)
    assert text.isascii()  # so UTF-8 (ours) and ISO-8859-1 (TorchServe's) read it alike
    meant = dict(items)
    assert javaproperties.loads(text) == meant
    assert javaproperties.load(io.BytesIO(text.encode("ascii"))) == meant
    assert ours(text) == meant
    return text


def test_snapshot_values_read_back_exactly(tmp_path: Path) -> None:
    text = assert_reads_back(WRITTEN)
    path = tmp_path / "20240101000000000-snapshot.cfg"
    path.write_text(text, encoding="ascii")
    assert {k: p.value for k, p in read_properties(path).items()} == dict(WRITTEN)
    assert "\\ leading=\\ \\ two leading spaces\n" not in text  # only a value's first space
    assert "\\ leading=\\  two leading spaces\n" in text


writer_text = st.text(
    st.characters(blacklist_categories=("Cs",))
    | st.sampled_from([" ", "=", ":", "#", "!", "\\", "\n", "\r", "\t", "\f", "\ud83d", "é"]),
    max_size=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(writer_text, writer_text, max_size=6))
def test_generated_snapshot_values_read_back_exactly(values: dict[str, str]) -> None:
    assert_reads_back(list(values.items()))


# --- the JDK itself, where one is installed -------------------------------------------------

JAVA_SOURCE = r"""
import java.io.*;
import java.nio.charset.StandardCharsets;
import java.nio.file.*;
import java.util.*;

/** load FILE...: each file read by Properties.load(Reader, UTF-8), one line per file.
 *  store FILE: the "hexkey hexvalue" lines of FILE written by Properties.store(OutputStream). */
public class PropertiesOracle {
    static String hex(String s) {
        StringBuilder b = new StringBuilder();
        for (char c : s.toCharArray()) b.append(String.format("%04x", (int) c));
        return b.toString();
    }

    static String unhex(String h) {
        StringBuilder b = new StringBuilder();
        for (int i = 0; i < h.length(); i += 4) b.append((char) Integer.parseInt(h.substring(i, i + 4), 16));
        return b.toString();
    }

    public static void main(String[] args) throws Exception {
        if (args[0].equals("store")) {
            Properties p = new Properties();
            for (String line : Files.readAllLines(Paths.get(args[1]))) {
                String[] kv = line.split(" ", -1);
                p.setProperty(unhex(kv[0]), unhex(kv[1]));
            }
            p.store(System.out, null);
            return;
        }
        for (int i = 1; i < args.length; i++) {
            Properties p = new Properties();
            StringBuilder out = new StringBuilder("P");
            try (Reader r = Files.newBufferedReader(Paths.get(args[i]), StandardCharsets.UTF_8)) {
                p.load(r);
                for (String k : p.stringPropertyNames()) out.append(" ").append(hex(k)).append(":").append(hex(p.getProperty(k)));
            } catch (IllegalArgumentException e) {
                out = new StringBuilder("malformed");
            }
            System.out.println(out);
        }
    }
}
"""


def _unhex(text: str) -> str:
    """Java's chars (UTF-16 units, in hex) as a str; a pair is one character."""
    return bytes.fromhex(text).decode("utf-16-be", "surrogatepass")


@pytest.fixture(scope="module")
def java(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``java PropertiesOracle ARGS...``, compiled once; skipped without a JDK."""
    if shutil.which("java") is None or shutil.which("javac") is None:
        pytest.skip("no JDK (java, javac) on PATH")
    folder = tmp_path_factory.mktemp("jdk")
    (folder / "PropertiesOracle.java").write_text(JAVA_SOURCE)
    subprocess.run(["javac", "PropertiesOracle.java"], cwd=folder, check=True, timeout=120)

    def run(*args: str) -> str:
        done = subprocess.run(
            ["java", "-cp", str(folder), "PropertiesOracle", *args],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    return run


def jdk_reads(
    java: Callable[..., str], tmp_path: Path, texts: list[str]
) -> list[dict[str, str] | str]:
    paths = []
    for i, text in enumerate(texts):
        path = tmp_path / f"{i}.properties"
        path.write_bytes(text.encode("utf-8"))
        paths.append(str(path))
    results: list[dict[str, str] | str] = []
    for line in java("load", *paths).splitlines():
        if line == "malformed":
            results.append(line)
            continue
        pairs = (entry.split(":") for entry in line.split(" ")[1:])
        results.append({_unhex(k): _unhex(v) for k, v in pairs})
    assert len(results) == len(texts)
    return results


def test_files_read_as_the_jdk_reads_them(java: Callable[..., str], tmp_path: Path) -> None:
    """The table, and files made of the same pieces as the generated ones (lone backslashes
    included), read by ``java.util.Properties`` in one JVM."""
    rng = random.Random(40)
    texts = [text for text, _, _ in TRICKY]
    texts += ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40))) for _ in range(400)]
    for text, jdk in zip(texts, jdk_reads(java, tmp_path, texts), strict=True):
        assert ours(text) == jdk, text


def test_snapshot_lines_as_the_jdk_writes_them(java: Callable[..., str], tmp_path: Path) -> None:
    """``Properties.store(OutputStream)`` writes each entry as we do (its order aside)."""
    rows = [
        " ".join(s.encode("utf-16-be", "surrogatepass").hex() for s in pair) for pair in WRITTEN
    ]
    (tmp_path / "items").write_text("\n".join(rows) + "\n")
    jdk_lines = java("store", str(tmp_path / "items")).splitlines()
    our_lines = properties_text(WRITTEN, 0.0).splitlines()
    assert our_lines[0] == "#Saving snapshot" and our_lines[1].startswith("#")
    assert jdk_lines[0].startswith("#")  # the date
    assert sorted(our_lines[2:]) == sorted(jdk_lines[1:])
