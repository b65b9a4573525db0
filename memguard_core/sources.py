"""Where a model's config comes from: a config.json, a local model folder, or a Hugging Face Hub id.

Hub ids are resolved by ``huggingface_hub.hf_hub_download`` (config.json only, never weights), so
the hub client's own rules apply: the cache under ``HF_HUB_CACHE`` / ``HF_HOME``, ``HF_HUB_OFFLINE``,
the token from ``hf auth login`` / ``HF_TOKEN`` for gated repos, and a fall-back to the cached copy
when the hub cannot be reached.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from .errors import ConfigError

__all__ = ["resolve_model_config", "looks_like_hub_id"]

# huggingface_hub's repo-id rule (``validate_repo_id``): one or two parts of [\w.-], no "--" or ".."
_HUB_ID = re.compile(r"^(?:[\w.-]{1,96}/)?[\w.-]{1,96}$")


def looks_like_hub_id(text: str) -> bool:
    """True when ``text`` is shaped like a hub repo id (``owner/name`` or ``name``) and not like a
    path (no leading ``.``, ``/`` or ``~``, no ``--`` / ``..``)."""
    return (isinstance(text, str) and bool(_HUB_ID.match(text)) and not text.startswith((".", "~"))
            and "--" not in text and ".." not in text and not text.endswith(".json"))


def resolve_model_config(model: str, *, revision: Optional[str] = None, field: str = "MODEL") -> str:
    """The path of the ``config.json`` that ``model`` names.

    Args:
        model: a path to a config.json, a local folder holding one (a saved or downloaded model),
            or a Hugging Face Hub repo id (``Qwen/Qwen2.5-7B-Instruct``).
        revision: hub branch, tag or commit (hub ids only); ``None`` = the default branch.
        field: the name the errors give the argument.

    Returns:
        A readable local path to config.json (for a hub id: the file in the HF cache).

    Raises:
        ConfigError (naming ``field``): a folder without config.json; a path that does not exist and
            is not shaped like a hub id; a hub id that is not in the cache while offline
            (``HF_HUB_OFFLINE=1``) or the hub is unreachable; a repo that does not exist, is gated
            without access, has no such revision or no config.json.
    """
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(field, "a config.json path, a model folder or a hub id (owner/name)", model)
    model = model.strip()
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        cfg = os.path.join(path, "config.json")
        if os.path.isfile(cfg) and os.access(cfg, os.R_OK):
            return cfg
        if os.path.lexists(cfg):   # there, but not a file this process can read
            why = ("a link to nothing" if os.path.islink(cfg) and not os.path.exists(cfg) else
                   "a folder" if os.path.isdir(cfg) else "not readable by this user")
            raise ConfigError(field, f"a model folder whose config.json can be read (it is {why})", cfg)
        if not os.access(path, os.R_OK | os.X_OK):
            raise ConfigError(field, "a model folder this user can read", path)
        raise ConfigError(field, "a model folder holding config.json", path)
    if not looks_like_hub_id(model):
        raise ConfigError(field, "an existing config.json path, a model folder, or a hub id (owner/name)", model)
    return _from_hub(model, revision, field)


def _from_hub(repo_id: str, revision: Optional[str], field: str) -> str:
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub import errors as hub_errors
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        raise ConfigError(field, "a local config.json (hub ids need huggingface_hub: pip install "
                          "huggingface_hub)", repo_id) from None
    try:
        # the local HF cache first (no network), then one bounded attempt at the hub: a plain
        # hf_hub_download retries an unreachable hub with backoff for ~25 s, a warning per retry
        try:
            return hf_hub_download(repo_id=repo_id, filename="config.json", revision=revision, local_files_only=True)
        except hub_errors.LocalEntryNotFoundError:
            if _hub_offline():
                raise
        _reach_hub(repo_id, revision)
        return hf_hub_download(repo_id=repo_id, filename="config.json", revision=revision)
    except hub_errors.GatedRepoError:
        raise ConfigError(field, "a gated repo you have access to: accept its terms on the hub and log "
                          "in (hf auth login, or HF_TOKEN)", repo_id) from None
    except hub_errors.RepositoryNotFoundError:
        raise ConfigError(field, "an existing hub repo id (or a local path; private repos need hf auth "
                          "login)", repo_id) from None
    except hub_errors.RevisionNotFoundError:
        raise ConfigError("--revision", f"a branch, tag or commit of {repo_id}", revision) from None
    except (hub_errors.LocalEntryNotFoundError, _Unreachable):
        why = "HF_HUB_OFFLINE is set" if _hub_offline() else "the hub cannot be reached"
        raise ConfigError(field, f"a hub id whose config.json is in the local HF cache ({why}; "
                          f"fetch it where the hub is reachable: hf download {repo_id} config.json, "
                          "or pass a local config.json)", repo_id) from None
    except hub_errors.EntryNotFoundError:
        raise ConfigError(field, "a hub repo with a config.json (a transformers model; adapter-only "
                          "or GGUF repos have none)", repo_id) from None
    except (hub_errors.HfHubHTTPError, hub_errors.HFValidationError, OSError, ValueError) as exc:
        raise ConfigError(field, "a hub id whose config.json can be fetched", f"{repo_id} ({exc})") from None


class _Unreachable(Exception):
    """The hub did not answer one metadata request (DNS, connection, timeout)."""


#: Seconds the one attempt at the hub may take (huggingface_hub's own metadata timeout is 10 s).
HUB_ATTEMPT_TIMEOUT_S = 10.0


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _reach_hub(repo_id: str, revision: Optional[str]) -> None:
    """One metadata request for the config (no retry).

    Raises:
        _Unreachable: the hub did not answer; huggingface_hub's own errors (gated, not found, ...) as
            they are.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub import errors as hub_errors

    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json", revision=revision), timeout=HUB_ATTEMPT_TIMEOUT_S)
    except (hub_errors.HfHubHTTPError, hub_errors.HFValidationError):
        raise
    except Exception as exc:   # huggingface_hub's HTTP client's connection / timeout errors
        raise _Unreachable(str(exc)) from None

