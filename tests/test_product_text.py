"""The product's text speaks only of the product: no line of the README, the docs, the benchmarks
(scripts, their output, their history), the tests, the library, the kernels, the config or the
examples refers to how fspeed was developed (work-plan stop or issue numbers, numbered defects,
"the issue's" figure, earlier stops, a session lent a GPU, the development machine's private paths).

Each pattern is narrow enough that the words' ordinary meanings pass: a process "session of its own",
a `stop` request, "DeepSpeed issue #2768" (another project's tracker), "the issued collectives"."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("README.md", "docs", "benchmarks", "tests", "fspeed", "kernels", "conf", "examples")
SUFFIXES = {".md", ".py", ".yaml", ".yml", ".txt", ".json", ".toml", ".cfg", ".ini", ".rst", ".sh", ".html", ".css",
            ".js"}
SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints", "site"}

# (what it catches, pattern); matched case-insensitively, line by line
PATTERNS = [
    ("a work-plan stop number", r"\bstops? \d+(\s*-\s*\d+)?\b(?!\s*(?:(?:ms|s|seconds|steps?|times)\b|%))"),
    ("a stop of the work plan", r"\b(this|that|earlier|previous|later|next|last|each) stops?\b(?![-_ ](request|signal|"
                                r"file|flag|event|handler|early))"),
    ("a stop's figures or code", r"\bstop \d+'s\b|\bstops'\s"),
    ("an issue number", r"\bissues? \d+"),
    ("a numbered defect", r"\bdefects? \d+"),
    ("an issue of the work plan", r"\b(an?|the|this|that|another|earlier|later|next|previous) ([\w-]+ )?issue('s)?\b"
                                  r"(?! #)"),
    ("a development session", r"\b(this|that|earlier|previous|later|next|last|another) sessions?\b|\bsessions? lent\b"),
    ("a machine lent for development", r"\blent (a|an|the) (GPU|machine|device|accelerator)\b"),
    ("the development machine's paths", r"/work/(\.library|shared|main)\b|\.library/device|machine-facts\.md"),
    ("the work brief", r"\bthe brief\b|\bas (the|its) (product's )?owner asked\b"),
]
COMPILED = [(what, re.compile(pattern, re.IGNORECASE)) for what, pattern in PATTERNS]


def scanned_files():
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            yield path
        elif path.is_dir():
            for file in sorted(path.rglob("*")):
                if (file.is_file() and file.suffix in SUFFIXES and not SKIPPED_DIRS & set(file.parts)
                        and file != Path(__file__).resolve()):
                    yield file


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the matched text) for every development-history reference in `text`."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in COMPILED:
            match = pattern.search(line)
            if match:
                out.append((number, what, match.group(0)))
    return out


def test_patterns_flag_development_history_and_pass_ordinary_words():
    flagged = ["figures at stop 37", "stop 36's cells", "over stops 36-38's fifteen runs", "Issue 18's defects",
               "Defect 7: a changed precision", "the issue's 1F1B", "this stop's code", "earlier stops' figures",
               "For a session lent a GPU", "runs 4-7 in a later session", "come with the data issue",
               "see /work/.library/device/README.md", "as the product's owner asked"]
    passed = ["start it in a session of its own", "a stop request ends the run", "the collectives issued before",
              "DeepSpeed issue #2768", "SIGSTOP 2 ranks", "--sigstops 2", "the run stops at step 3",
              "stop_requests", "issues four collectives", "stop 3 seconds later", "the step stops early",
              "a DeepSpeed issue #1234 workaround"]
    assert all(findings(text) for text in flagged), [t for t in flagged if not findings(t)]
    assert not any(findings(text) for text in passed), [(t, findings(t)) for t in passed if findings(t)]


def test_no_product_text_refers_to_how_it_was_developed():
    hits = []
    for file in scanned_files():
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        hits += [f"{file.relative_to(ROOT)}:{number}: {what}: {matched!r}" for number, what, matched in findings(text)]
    assert not hits, "development history in the product's text:\n" + "\n".join(hits)
