"""Training prompts from text that ships with the machine: the Python standard library's sources
and docstrings, and the documentation of installed packages, put through instruction templates
(explain, summarize, rewrite, continue, answer, write). Never the benchmark prompts.

Everything is deterministic for a seed, so a resumed run rebuilds the same prompt list.
"""

from __future__ import annotations

import ast
import random
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

MAX_SNIPPET_CHARS = 900

CODE_TEMPLATES = (
    "Explain what this Python code does.\n\n{code}",
    "Rewrite this function with clearer variable names. Return the whole code.\n\n{code}",
    "Add comments to this code and return it.\n\n{code}",
    "Find possible bugs in this code.\n\n{code}",
    "Summarize this code in one paragraph.\n\n{code}",
    "Convert this function to use type hints. Return the whole code.\n\n{code}",
)
TASK_TEMPLATES = (
    "Write a Python function that does the following: {task}",
    "How would I {task_lower} in Python? Show an example.",
    "Write a short program that uses {name}.",
)
TEXT_TEMPLATES = (
    "Summarize the following text.\n\n{text}",
    "Summarize the following text in two sentences.\n\n{text}",
    "Rewrite the following text in simpler words.\n\n{text}",
    "List the main points of this text.\n\n{text}",
    "{text}\n\nWhat is the main idea of this text?",
    "{text}\n\nAnswer in one sentence: what does this describe?",
)
QUESTION_TEMPLATES = (
    "What is {name} used for?",
    "Explain {name} to a beginner.",
    "Give three tips for using {name}.",
    "What are the advantages of {name}?",
)


@dataclass(frozen=True)
class TrainingPrompt:
    text: str
    chat: bool  # through the chat template (True) or as raw text to continue (False)


def _python_files(limit: int) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))
    files += sorted(p for p in stdlib.glob("*/*.py") if "test" not in p.parts)
    return files[:limit]


def _doc_files(limit: int) -> list[Path]:
    site = Path(sysconfig.get_paths()["purelib"])
    docs = sorted(site.glob("*.dist-info/METADATA")) + sorted(site.glob("**/*.md"))[:2000] + sorted(site.glob("**/*.rst"))[:2000]
    return docs[:limit]


def _functions(source: str) -> Iterator[tuple[str, str, str]]:
    """(name, first docstring line, source) of the module's top-level functions and methods."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
            code = textwrap.dedent("\n".join(lines[node.lineno - 1: node.end_lineno]))
            doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
            if 80 <= len(code) <= MAX_SNIPPET_CHARS:
                yield node.name, doc, code


def _paragraphs(text: str) -> Iterator[str]:
    for block in text.split("\n\n"):
        block = " ".join(block.split())
        if 200 <= len(block) <= MAX_SNIPPET_CHARS and block.count("|") < 3 and not block.startswith(("..", "::", ">>>")):
            yield block


# Source files read per prompt asked for, within the caps below: parsing every standard-library
# module takes about 20 s on a 2-core machine, which a run of a few hundred prompts need not pay.
# Each file yields several functions and paragraphs, so the sources still outnumber the prompts.
FILES_PER_PROMPT = 8
MAX_PYTHON_FILES, MAX_DOC_FILES = 1500, 3000


def build_prompts(count: int, seed: int = 0) -> list[TrainingPrompt]:
    """`count` prompts mixed over the templates: about 45 % code, 35 % text, 10 % questions,
    10 % raw continuations. The same (count, seed) gives the same prompts."""
    rng = random.Random(seed)
    functions: list[tuple[str, str, str]] = []
    module_names: list[str] = []
    for path in _python_files(min(MAX_PYTHON_FILES, max(100, FILES_PER_PROMPT * count))):
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        functions.extend(_functions(source))
        module_names.append(path.stem)
    paragraphs: list[str] = []
    for path in _doc_files(min(MAX_DOC_FILES, max(200, 2 * FILES_PER_PROMPT * count))):
        try:
            paragraphs.extend(_paragraphs(path.read_text(encoding="utf-8", errors="ignore")))
        except OSError:
            continue
    if not functions or not paragraphs:
        raise RuntimeError(f"found no local text to build prompts from (python {sys.version_info[:2]})")
    rng.shuffle(functions)
    rng.shuffle(paragraphs)
    prompts: list[TrainingPrompt] = []
    fi = pi = 0
    while len(prompts) < count:
        roll = rng.random()
        if roll < 0.30:
            name, doc, code = functions[fi % len(functions)]
            fi += 1
            prompts.append(TrainingPrompt(rng.choice(CODE_TEMPLATES).format(code=code), True))
        elif roll < 0.45:
            name, doc, code = functions[fi % len(functions)]
            fi += 1
            if len(doc) < 15:
                continue
            task = doc.rstrip(".")
            prompts.append(TrainingPrompt(rng.choice(TASK_TEMPLATES).format(task=task, task_lower=task[0].lower() + task[1:],
                                                                            name=name), True))
        elif roll < 0.80:
            text = paragraphs[pi % len(paragraphs)]
            pi += 1
            prompts.append(TrainingPrompt(rng.choice(TEXT_TEMPLATES).format(text=text), True))
        elif roll < 0.90:
            name = rng.choice(module_names + [f.split()[0] for f in paragraphs[:200]])
            prompts.append(TrainingPrompt(rng.choice(QUESTION_TEMPLATES).format(name=name), True))
        else:
            source = rng.choice((paragraphs[pi % len(paragraphs)], functions[fi % len(functions)][2]))
            pi += 1
            fi += 1
            prompts.append(TrainingPrompt(source[: rng.randint(60, 300)], False))
    return prompts
