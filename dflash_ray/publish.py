"""`dflash-ray push REPO_ID [export=DIR] [--private]`: publish an export to the Hugging Face hub with
huggingface_hub (`HfApi.create_repo(exist_ok=True)`, then `upload_folder` of the export's files).

The folder must be an export: config.json, model.safetensors, README.md (the model card `export_drafter`
writes) and the drafter's code that transformers' trust_remote_code loads (run_layout.py EXPORT_FILES). Before the upload
the card is rewritten to name REPO_ID in its serve commands
(its run facts kept, read from its front matter). The token is huggingface_hub's (`hf auth login`, or
HF_TOKEN); the hub is HF_ENDPOINT's. A missing token, a bad repo id, an unreachable hub or a refusal by it:
one line, exit code 2.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from dflash_ray.errors import UserError
from dflash_ray.run_layout import EXPORT_FILES
EXPORT_OVERRIDE = "export="


def export_files(export_dir: str) -> list[str]:
    """The files of an export that are published; UserError naming what is missing when the folder is
    not an export."""
    folder = Path(export_dir)
    if not folder.is_dir():
        raise UserError(f"{export_dir}: no such directory (an export: `dflash-ray export`, or export=DIR)")
    missing = [name for name in EXPORT_FILES if not (folder / name).is_file()]
    if missing:
        raise UserError(f"{export_dir}: not an export of dflash-ray (missing {', '.join(missing)}; "
                        "`dflash-ray export` writes them all)")
    return list(EXPORT_FILES)


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the hub cannot be reached or refuses: its HTTP errors, the HTTP
    library's own errors (the base class huggingface_hub's HTTP error extends: httpx2's or httpx's
    HTTPError, which covers connection and timeout errors; requests' in huggingface_hub < 1), offline mode,
    sockets."""
    import importlib

    from huggingface_hub import errors

    found: list[type[BaseException]] = [errors.HfHubHTTPError, OSError]
    found += [base for base in errors.HfHubHTTPError.__mro__
              if issubclass(base, Exception) and base.__module__.split(".")[0] not in ("huggingface_hub", "builtins")]
    for module, name in (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests.exceptions", "RequestException")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    if hasattr(errors, "OfflineModeIsEnabled"):
        found.append(errors.OfflineModeIsEnabled)
    return tuple(found)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text or type(e).__name__)[:300]


@contextmanager
def _hub_call(repo_id: str):
    """A call to the hub: what it raises when unreachable or refusing becomes one line (UserError)."""
    from huggingface_hub import constants

    try:
        yield
    except _hub_errors() as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status is not None:
            raise UserError(f"the hub at {constants.ENDPOINT} refused {repo_id} (HTTP {status}): {_one_line(e)}") from e
        raise UserError(f"the hub at {constants.ENDPOINT} could not be reached ({type(e).__name__}: "
                        f"{_one_line(e)})") from e


def push(export_dir: str, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Create `repo_id` on the hub (kept if it exists) and upload the export's files in one commit;
    returns the commit's URL. UserError (one line) for a folder that is not an export, a bad repo id, no
    token, an unreachable hub or a refusal."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    files = export_files(export_dir)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UserError(f"repo id '{repo_id}': {_one_line(e)}") from e
    if "/" not in repo_id:
        raise UserError(f"repo id '{repo_id}': give it as OWNER/NAME (your user or organisation, then the name)")
    token = token or get_token()
    if not token:
        raise UserError("no Hugging Face token: log in with `hf auth login`, or set HF_TOKEN")
    api = HfApi(token=token)
    with _hub_call(repo_id):
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    from dflash_ray.model.export import read_card_facts, write_model_card  # torch: only once the hub answered

    facts = read_card_facts(export_dir)
    if facts.get("repo_id") != repo_id:  # the card's serve commands name the hub repo
        write_model_card(export_dir, {**facts, "repo_id": repo_id})
    with _hub_call(repo_id):
        commit = api.upload_folder(folder_path=str(export_dir), repo_id=repo_id, repo_type="model",
                                   allow_patterns=files, commit_message="Upload DFlash drafter (dflash-ray push)")
    return getattr(commit, "commit_url", None) or str(commit)


def take_export_override(overrides: list[str]) -> tuple[list[str], str | None]:
    """`export=DIR` out of push's overrides (it is push's argument, not a config key): (the rest, DIR)."""
    rest, export = [], None
    for word in overrides:
        if word.startswith(EXPORT_OVERRIDE):
            export = word[len(EXPORT_OVERRIDE):]
        else:
            rest.append(word)
    if export == "":
        raise UserError("export=: give the export directory (export=DIR)")
    return rest, export


def push_command(cfg, args) -> int:
    """`dflash-ray push REPO_ID [export=DIR] [--private] [overrides]`: the run's export (<run.dir>/export,
    or DIR) to the hub."""
    from dflash_ray.run_layout import RunLayout

    export_dir = getattr(args, "export", None) or str(RunLayout(cfg.run.dir).export)
    url = push(export_dir, args.repo_id, private=bool(getattr(args, "private", False)))
    print(f"pushed {export_dir} -> {url}")
    return 0
