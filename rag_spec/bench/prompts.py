"""Benchmark prompts: RAG questions over the default corpus, and open-ended requests."""

RAG_QUESTIONS = [
    "How do I join two path components with os.path?",
    "How do I parse a JSON string into a Python object?",
    "How can I sort a list in place?",
    "How do I match a regular expression at the start of a string?",
    "How do I run a shell command and capture its output with subprocess?",
    "How do I read rows from a CSV file?",
    "How do I compute the SHA-256 hash of some bytes?",
    "How do I measure elapsed time precisely?",
    "How do I compress data with zlib?",
    "How do I protect shared data between threads with a lock?",
    "How do I create a temporary directory that is removed automatically?",
    "How do I copy a whole directory tree?",
    "How do I get the current date and time?",
    "How do I pick a random element from a list?",
    "How do I count how often each item occurs in a list?",
    "How do I serialize a Python object with pickle?",
    "How do I parse command-line arguments?",
    "How do I read a file line by line?",
    "How do I format a number with thousands separators?",
    "How do I split a string on whitespace?",
    "How do I make an HTTP request with urllib?",
    "How do I define a data class?",
    "How do I log messages to a file?",
    "How do I run a function in a thread pool?",
    "How do I encode bytes as base64?",
    "How do I check whether a file exists?",
    "How do I get environment variables?",
    "How do I cache the results of a function?",
]

OPEN_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash table works.",
    "Give me five tips for writing clean code.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle.",
    "Write a poem about the sea.",
    "Explain recursion to a beginner.",
    "What are the benefits of unit testing?",
]

# RAG questions no constant was fitted on (the drafts' constants and depths were chosen on the
# first eight); the lookahead bench asks them too (every question, or its first --limit)
HELD_OUT_RAG_QUESTIONS = RAG_QUESTIONS[8:]

# open-ended prompts no constant was fitted on (the labs' held-out set)
HELD_OUT_OPEN_PROMPTS = [
    "Explain how public-key cryptography works.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP?",
    "Describe how vaccines train the immune system.",
    "Give me three tips for a job interview.",
    "Why is the sky blue? Explain briefly.",
    "Summarize the causes of the French Revolution.",
    "How does a binary search work? Give an example.",
]


def load_questions(path: str) -> list[str]:
    """Questions from a file: a JSON list, or JSON lines; each item a string or an object with
    a "question" (or "prompt") string."""
    import json
    from pathlib import Path

    from rag_spec.errors import RagSpecError

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        msg = f"Cannot read the questions file {path}: {error.strerror or error}."
        raise RagSpecError(msg) from error
    try:
        items = json.loads(text)
        if not isinstance(items, list):
            items = [items]
    except json.JSONDecodeError:
        try:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            msg = (f"{path} line {error.lineno}: not JSON. Give a JSON list of questions, or "
                   'JSON lines: one "question" string or {"question": "..."} object per line.')
            raise RagSpecError(msg) from error
    questions = [item.get("question", item.get("prompt")) if isinstance(item, dict) else item
                 for item in items]
    bad = next((i for i, q in enumerate(questions) if not isinstance(q, str) or not q.strip()),
               None)
    if bad is not None or not questions:
        where = f"item {bad + 1}" if bad is not None else "the file"
        msg = (f"{path}: {where} holds no question. Each item must be a non-empty string or an "
               'object like {"question": "..."}.')
        raise RagSpecError(msg)
    return questions
