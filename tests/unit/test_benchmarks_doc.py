"""Item 10 of issue 33: BENCHMARKS.md is a reference: one section per benchmark, none labelled by when
it was made, and every script in benchmarks/ named in it (and in benchmarks/README.md)."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: words that label a section by the order or time of its making ("Tenth session", "Previous matrix")
WHEN = re.compile(r"\b(session|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\w+th run|"
                  r"previous|earlier|later|latest|newest|old|new run|rerun|again|history|update[ds]?|"
                  r"yesterday|today|\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2})\b", re.IGNORECASE)


def _doc(name):
    return open(os.path.join(ROOT, name), encoding="utf-8").read()


def _headings(text):
    return re.findall(r"^(#{2,6}) (.+)$", text, re.M)


def _scripts():
    return sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks")) if f.endswith(".py"))


def test_every_benchmark_script_is_named():
    text, readme = _doc("BENCHMARKS.md"), _doc("benchmarks/README.md")
    assert [s for s in _scripts() if f"benchmarks/{s}" not in text] == []
    assert [s for s in _scripts() if f"`{s}`" not in readme] == []


def test_one_section_per_benchmark():
    sections = [title for level, title in _headings(_doc("BENCHMARKS.md")) if level == "##"]
    benchmarks = [m for title in sections for m in re.findall(r"`(benchmarks/[^`]+)`", title)]
    assert len(benchmarks) == len(set(benchmarks)), benchmarks
    assert len(sections) == len(set(sections))


def test_no_section_is_labelled_by_when_it_was_made():
    labelled = [title for _, title in _headings(_doc("BENCHMARKS.md")) if WHEN.search(title)]
    assert labelled == []
    assert not re.search(r"\bsession\b", _doc("BENCHMARKS.md"), re.IGNORECASE)


def test_every_figure_the_readme_quotes_is_in_benchmarks():
    """The README quotes measurements (MFU %, speed-up ratios like 1.293x, seconds): each must appear in
    BENCHMARKS.md's current sections, so that the README cannot keep a figure BENCHMARKS.md dropped (it quoted an
    H200 run's 43.9 % / 1.14x after BENCHMARKS.md had moved to the H100 run's 45.6 % / 1.29x)."""
    readme, bench = _doc("README.md"), _doc("BENCHMARKS.md")
    figures = set(re.findall(r"\b(\d+(?:\.\d+)?) ?%", readme)) | set(re.findall(r"\b(\d+\.\d+)x\b", readme))
    assert figures, "the README quotes no figure: this test checks nothing"
    missing = sorted(f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", bench))
    assert missing == [], f"README figures not in BENCHMARKS.md: {missing}"
    for gpu in re.findall(r"\b(H100|H200|A100|V100)\b", readme):
        assert gpu in bench, gpu
