"""Text that is on a Debian machine with Python, never a benchmark: manual pages, gettext catalogues (translated
program messages, for translation into English), the docstrings of Python's standard library, and the ISO
country list. Every reader returns a sorted list, so a seeded choice from it is reproducible on a machine
with the same packages."""

from __future__ import annotations

import gettext
import glob
import gzip
import importlib
import inspect
import json
import os
import re
import subprocess

# stdlib modules whose docstrings become instructions (importable everywhere, documented in English)
MODULES = (
    "abc argparse array ast base64 bisect calendar cmath codecs collections colorsys configparser contextlib copy "
    "csv dataclasses datetime decimal difflib dis email enum filecmp fnmatch fractions ftplib functools getopt "
    "gettext glob gzip hashlib heapq hmac html http.client imaplib inspect io ipaddress itertools json keyword "
    "linecache locale logging lzma mailbox math mimetypes numbers operator optparse os os.path pathlib pickle "
    "pkgutil platform plistlib poplib pprint queue quopri random re reprlib sched secrets selectors shelve shlex "
    "shutil smtplib socket sqlite3 statistics string struct subprocess tarfile tempfile textwrap threading "
    "timeit tokenize traceback types typing unicodedata unittest urllib.parse urllib.request uuid warnings "
    "wave weakref xml.dom.minidom xml.etree.ElementTree zipfile zlib"
).split()
# gettext languages whose messages are translated into English, with their English names
LANGUAGES = {
    "de": "German",
    "fr": "French",
    "es": "Spanish",
    "it": "Italian",
    "pt": "Portuguese",
    "nl": "Dutch",
    "sv": "Swedish",
    "pl": "Polish",
    "ru": "Russian",
    "zh_CN": "Chinese",
    "ja": "Japanese",
}
LOCALE_DIR = "/usr/share/locale"
MAN_DIRS = ("/usr/share/man/man1", "/usr/share/man/man8", "/usr/share/man/man5")
ISO_COUNTRIES = "/usr/share/iso-codes/json/iso_3166-1.json"


def documented_objects() -> list[tuple[str, str]]:
    """(qualified name, docstring) of the public functions, classes and modules in MODULES."""
    found = []
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a module missing from this Python build
            continue
        if inspect.getdoc(module):
            found.append((module_name, inspect.getdoc(module)))
        for name, member in inspect.getmembers(module):
            if name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
                continue
            if (inspect.isfunction(member) or inspect.isclass(member)) and inspect.getdoc(member):
                found.append((f"{module_name}.{name}", inspect.getdoc(member)))
    return found


def prose_paragraphs(text: str, min_chars: int = 200, max_chars: int = 900) -> list[str]:
    """The text's prose paragraphs of `min_chars` or more (code and option lists left out), cut to `max_chars`."""
    result = []
    for block in re.split(r"\n\s*\n", text):
        line = " ".join(block.split())
        if len(line) >= min_chars and ">>>" not in line and line.count("(") < 6 and not line.startswith("-"):
            result.append(line[:max_chars].rsplit(" ", 1)[0] if len(line) > max_chars else line)
    return result


def man_page_names(per_family: int = 3) -> list[str]:
    """Paths of the manual pages in MAN_DIRS, sorted, at most `per_family` of a family of pages whose names share
    their first word (gcloud alone ships thousands of nearly identical pages)."""
    kept, families = [], {}
    for path in sorted(p for folder in MAN_DIRS for p in glob.glob(os.path.join(folder, "*.gz"))):
        family = re.split(r"[_\-.]", os.path.basename(path))[0]
        families[family] = families.get(family, 0) + 1
        if families[family] <= per_family:
            kept.append(path)
    return kept


def render_man_page(path: str) -> str | None:
    """A manual page as plain text, 80 columns, or None when `man` cannot render it (or is missing)."""
    try:
        with gzip.open(path, "rt", errors="replace") as source:
            if source.read(200).startswith(".so "):  # a link to another page
                return None
        done = subprocess.run(
            ["man", "--no-justification", "--no-hyphenation", "-l", "-P", "cat", path],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": "0"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = re.sub(r".\x08", "", done.stdout)  # overstrike bold and underline
    return text if done.returncode == 0 and len(text) > 400 else None


def man_passage(text: str, min_words: int, max_words: int) -> str:
    """The leading sections of a rendered manual page, whole lines, up to `max_words` words (at least
    `min_words` where the page has them); the running header and footer lines are dropped."""
    lines = [line.strip() for line in text.splitlines()[1:-1]]
    kept, words = [], 0
    for line in lines:
        count = len(line.split())
        if words + count > max_words and words >= min_words:
            break
        kept.append(line)
        words += count
    return re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip()


def translated_messages(language: str, max_per_catalogue: int = 200) -> list[tuple[str, str]]:
    """(English message, translation) pairs from the gettext catalogues of `language`: prose of 6-60 words,
    without format codes, markup or option lists, one line each."""
    pairs = set()
    for path in sorted(glob.glob(os.path.join(LOCALE_DIR, language, "LC_MESSAGES", "*.mo"))):
        try:
            with open(path, "rb") as handle:
                catalogue = gettext.GNUTranslations(handle)._catalog
        except (OSError, ValueError, UnicodeDecodeError):  # a damaged catalogue, or one in an unknown charset
            continue
        found = 0
        for english, translated in sorted((k, v) for k, v in catalogue.items() if isinstance(k, str) and k):
            english, translated = " ".join(english.split()), " ".join(translated.split())
            if found >= max_per_catalogue or not 6 <= len(translated.split()) <= 60:
                continue
            if re.search(r"[%{}<>_\\|=]|--|\s-\w|^\W", translated) or translated == english:
                continue
            pairs.add((english, translated))
            found += 1
    return sorted(pairs)


def countries() -> list[str]:
    """Country names from the ISO 3166 list (iso-codes), or a short built-in list without it."""
    try:
        with open(ISO_COUNTRIES, encoding="utf-8") as handle:
            return sorted(entry["name"] for entry in json.load(handle)["3166-1"] if "," not in entry["name"])
    except OSError:
        return ["Argentina", "Brazil", "Canada", "Egypt", "France", "India", "Japan", "Kenya", "Norway", "Peru"]


# ---- prose from a wheel: news articles and encyclopedia articles ----
# gensim's wheel (PyPI) carries test data that no benchmark uses: 300 Australian Broadcasting Corporation news
# articles (the Lee corpus, one per line) and a shortened English Wikipedia dump. `pip download --no-deps
# gensim==4.4.0` fetches it; nothing is installed, the files are read from the zip.
PROSE_WHEEL = "gensim==4.4.0"
NEWS_FILE = "gensim/test/test_data/lee_background.cor"
WIKI_FILE = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def clean_wikitext(text: str) -> str:
    """Plain paragraphs from an article's wikitext: templates, tables, references, files, categories, markup and
    headings removed; links become their shown text. Paragraphs under 20 words (lists, captions) are dropped."""
    text = re.sub(r"<!--.*?-->|<ref[^>/]*/>|<ref[^>]*>.*?</ref>", "", text, flags=re.S)
    for _ in range(4):  # templates and tables nest
        text = re.sub(r"\{\{[^{}]*\}\}|\{\|[^{}]*?\|\}", "", text, flags=re.S)
    text = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", text, flags=re.I)
    text = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", text)  # [[target|shown]] -> shown
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]|\[https?://\S+\]", r"\1", text)
    text = re.sub(r"'{2,}|<[^>]+>|&nbsp;", " ", text)
    paragraphs = []
    for block in text.split("\n"):
        line = " ".join(block.split())
        if line.startswith(("=", "*", "#", ":", ";", "|", "!", "{", "}")) or len(line.split()) < 20:
            continue
        paragraphs.append(line)
    return "\n\n".join(paragraphs)


def wheel_prose(wheel: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(news articles of 100 words or more, (title, plain text) of encyclopedia articles of 300 words or more)
    from the wheel `wheel` (a path to PROSE_WHEEL's .whl)."""
    import bz2
    import html
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        news = archive.read(NEWS_FILE).decode("utf-8")
        dump = bz2.decompress(archive.read(WIKI_FILE)).decode("utf-8")
    articles = []
    for title, body in re.findall(r"<title>(.*?)</title>.*?<text[^>]*>(.*?)</text>", dump, flags=re.S):
        body = html.unescape(body)
        if body.lstrip().upper().startswith("#REDIRECT"):
            continue
        text = clean_wikitext(body)
        if len(text.split()) >= 300:
            articles.append((html.unescape(title), text))
    stories = [" ".join(line.split()) for line in news.splitlines() if len(line.split()) >= 100]
    return sorted(stories), sorted(articles)
