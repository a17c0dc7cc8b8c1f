"""Models and datasets named as the field names them: ``ORG/NAME`` on the Hugging Face hub.

A spec is ``ORG/NAME[@REVISION][:PART]``: the repository, optionally a branch, tag or commit, and for a dataset the
file, folder or split to read (``HuggingFaceH4/MATH-500:test``). It is fetched once with ``huggingface_hub`` into
the standard cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``) and read from it
afterwards without asking the hub: a snapshot already in the cache is used as it is (name a commit as the revision
to pin one, or refresh the cache with ``hf download``). With ``HF_HUB_OFFLINE=1`` only the cache is read. A name
that cannot be had is one line saying where it was looked for and how to fetch it.

A local path always wins: a spec is a hub name only when no file or directory of that name exists; where the cache
holds a repository of that name too, the run says which it took (``shadowed``). A spec that reads as a hub name but
breaks its spelling (``acme//toy``, ``acme/toy@``, a space) is said to be no valid hub name (``malformed``) rather
than a missing local path.
"""

from __future__ import annotations

import re
from pathlib import Path

# org/name as the hub spells them (letters, digits, '-', '_', '.'), then @revision and :part, both optional.
_SPEC = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<revision>[\w./-]+?))?(?::(?P<part>[^:]+))?$")
DATA_SUFFIXES = (".jsonl", ".parquet", ".json")
# What a model needs (weights, config, tokenizer, chat template); a repository's other formats are left on the hub.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "LICENSE*"]
DATASET_FILES = [f"*{suffix}" for suffix in DATA_SUFFIXES] + ["LICENSE*", "README.md"]
SPLITS = ("train", "test", "validation", "valid", "dev")


def is_hub_name(spec: str) -> bool:
    """Whether ``spec`` names a hub repository: ``ORG/NAME[@REV][:PART]`` with no local file or directory of that
    name, and not a path to a data file (``data/train.jsonl`` missing here is a missing file, not a repository)."""
    match = _SPEC.match(spec)
    if match is None or Path(spec).exists():
        return False
    return not match["repo"].endswith(DATA_SUFFIXES) or bool(match["revision"] or match["part"])


_SAID: set[str] = set()  # the shadowed specs already said, once a process


def malformed(spec: str) -> str | None:
    """Why ``spec``, written as a hub name would be (``ORG/...``, relative, no local path of that name), is not a valid
    one; None for a valid hub name, an existing local path or a path that reads as one (``/``, ``.``, ``~``)."""
    if _SPEC.match(spec) or Path(spec).exists() or spec.startswith(("/", ".", "~")) or "/" not in spec.strip("/"):
        return None
    repo = re.split(r"[@:]", spec, maxsplit=1)[0]
    if re.search(r"\s", spec):
        why = "it holds whitespace"
    elif "//" in repo or repo.endswith("/") or repo.startswith("/"):
        why = "a part of it between slashes is empty"
    elif repo.count("/") > 1:
        why = "a repository is ORG/NAME, one slash"
    elif re.search(r"@(:|$)", spec) or re.search(r":$", spec):
        why = "nothing follows its '@' or ':'"
    else:
        why = "it holds characters the hub does not allow (letters, digits, '-', '_', '.')"
    return f"not a valid hub name ({why}; ORG/NAME[@REVISION][:PART]), and no such local path"


def shadowed(spec: str, repo_type: str = "model") -> str | None:
    """The line that says a local path ``spec`` was taken where the hub cache also holds a repository of that name;
    None otherwise, and for a spec already said in this process."""
    if spec in _SAID or not _SPEC.match(spec) or not Path(spec).exists():
        return None
    from huggingface_hub import constants

    repo = _SPEC.match(spec)["repo"]
    if not (Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo.replace('/', '--')}").is_dir():
        return None
    _SAID.add(spec)
    return (f"{spec}: the local path {Path(spec).resolve()} is taken, not the hub's {repo} in the Hugging Face cache; "
            f"move or rename the local one to use the cache's")  # fmt: skip


def parse(spec: str) -> tuple[str, str | None, str | None]:
    """``(repo_id, revision, part)`` of a hub spec (``ValueError`` for anything else)."""
    match = _SPEC.match(spec)
    if match is None:
        raise ValueError(f"{spec}: not a hub name (ORG/NAME[@REVISION][:PART])")
    return match["repo"], match["revision"], match["part"]


def model_dir(spec: str, key: str | None = "model.path") -> str:
    """The local directory of a model named on the hub (its snapshot in the cache, fetched if missing)."""
    repo, revision, part = parse(spec)
    if part:
        raise FileNotFoundError(f"{_named(key, spec)}: a model is a whole repository; drop ':{part}'")
    return str(
        _snapshot(spec, repo, revision, "model", MODEL_FILES, key, complete=lambda d: (d / "config.json").exists())
    )


def dataset_files(spec: str, key: str | None = "data.train") -> tuple[Path, list[Path]]:
    """The snapshot directory of a dataset named on the hub and its data files (JSONL, parquet, JSON) in reading
    order; ``:PART`` keeps a file, a folder, or a split (files whose path names it: ``train``, ``test``, ...)."""
    repo, revision, part = parse(spec)
    snapshot = _snapshot(spec, repo, revision, "dataset", DATASET_FILES, key, complete=lambda d: bool(_data_files(d)))
    files = _data_files(snapshot)
    if part:
        files = [f for f in files if _selected(f.relative_to(snapshot), part)]
        if not files:
            holds = _listing(snapshot)
            raise FileNotFoundError(
                f"{_named(key, spec)}: no data file or split of {repo} is {part!r}; it holds {holds}"
            )
    splits = sorted({s for f in files if (s := split_of(f.relative_to(snapshot)))})
    if len(splits) > 1:
        raise FileNotFoundError(f"{_named(key, spec)}: {repo} holds the splits {', '.join(splits)}; name one, e.g. "
                                f"{repo}:{splits[0]}")  # fmt: skip
    return snapshot, files


def split_of(relative: Path) -> str | None:
    """The split a data file belongs to by the hub's naming (``data/train-00000-of-00002.parquet``, ``test.jsonl``,
    ``validation/x.parquet``): the first of ``SPLITS`` that is a word of its path."""
    words = set(re.split(r"[^a-z]+", str(relative).lower()))
    return next((split for split in SPLITS if split in words), None)


def _selected(relative: Path, part: str) -> bool:
    text = relative.as_posix()
    return text == part or text.startswith(part.rstrip("/") + "/") or split_of(relative) == part


def _data_files(snapshot: Path) -> list[Path]:
    """JSONL and parquet files, else JSON ones: beside real data a ``.json`` file is the repository's metadata."""
    files = sorted(p for p in snapshot.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
    return [p for p in files if p.suffix != ".json"] or files


def _listing(snapshot: Path) -> str:
    names = [f.relative_to(snapshot).as_posix() for f in _data_files(snapshot)]
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") if names else "no data file"


def _named(key: str | None, spec: str) -> str:
    return f"{key} {spec}" if key else spec


def _snapshot(spec, repo, revision, repo_type, patterns, key, complete) -> Path:
    """The cached snapshot of ``repo`` at ``revision`` when it is there and ``complete``, else fetched (unless the
    hub is off): one ``FileNotFoundError`` line for every way that fails."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    where = f"{repo_type} {repo}" + (f" at {revision}" if revision else "")
    kwargs = dict(repo_type=repo_type, revision=revision, allow_patterns=patterns)
    try:
        cached = Path(snapshot_download(repo, local_files_only=True, **kwargs))
        if complete(cached):
            return cached
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        cached = None
    fetch = f"hf download {repo}" + (" --repo-type dataset" if repo_type == "dataset" else "")
    fetch += f" --revision {revision}" if revision else ""
    if constants.HF_HUB_OFFLINE:
        state = "incomplete" if cached else "not"
        raise FileNotFoundError(
            f"{_named(key, spec)}: no such local path, and the {where} is {state} in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) with HF_HUB_OFFLINE set; fetch it where the hub is reachable: {fetch}"
        )
    try:
        fetched = Path(snapshot_download(repo, **kwargs))
    except (HfHubHTTPError, LocalEntryNotFoundError, HFValidationError, OSError, ValueError) as err:
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        reason = f"could not be fetched from the Hugging Face hub ({first[:200]}); check the name, or run: {fetch}"
        raise FileNotFoundError(f"{_named(key, spec)}: no such local path, and the {where} {reason}") from None
    if not complete(fetched):
        raise FileNotFoundError(
            f"{_named(key, spec)}: the {where} holds no {'config.json' if repo_type == 'model' else 'data file'}"
        )
    return fetched
