"""Models named by a Hugging Face Hub id, `ORG/NAME[@REVISION]`, fetched through `huggingface_hub`
(its cache, HF_TOKEN, HF_HUB_OFFLINE, HF_ENDPOINT): the orchestrator fetches the small files
(config, tokenizer, chat template, index), each worker only the safetensors files that hold its
stage's tensors. A path that exists is a folder, never an id."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from shardspec.models.config import ConfigError

log = logging.getLogger("shardspec.hub")
logging.getLogger("httpx").setLevel(logging.WARNING)  # (huggingface_hub's client logs every request at INFO)

# what the orchestrator reads of a model: never its weights
SMALL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
               "vocab.json", "merges.txt")
_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
_REVISION = re.compile(r"[\w.\-/]{1,200}")
_COMMIT = re.compile(r"[0-9a-f]{40}")

FileProgress = Callable[[int, int], None]  # (bytes just fetched, the size of the file they are of)


@dataclass(frozen=True)
class HubRef:
    """A Hub model: repository and revision (None: the default branch)."""

    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo if self.revision is None else f"{self.repo}@{self.revision}"

    @property
    def pinned(self) -> bool:
        return self.revision is not None and _COMMIT.fullmatch(self.revision) is not None


def parse_ref(model: str) -> HubRef | None:
    """`model` as a Hub id, or None when it is a path: one that exists, or that has no ORG/NAME
    shape (absolute, ./relative, more than one slash before an @)."""
    if Path(model).exists():
        return None
    repo, at, revision = model.partition("@")
    if not _ID.fullmatch(repo) or ".." in repo or (at and not _REVISION.fullmatch(revision)):
        return None
    return HubRef(repo, revision or None)


@dataclass(frozen=True)
class HubModel:
    """A resolved Hub model: the revision pinned to its commit, and the local snapshot folder that
    holds what was fetched of it so far."""

    ref: HubRef
    commit: str
    folder: Path

    @property
    def pinned(self) -> str:
        """`ORG/NAME@COMMIT`: what the workers are told to load."""
        return f"{self.ref.repo}@{self.commit}"


def resolve(ref: HubRef, names: Iterable[str] = SMALL_FILES) -> HubModel:
    """Fetch the files among `names` the repository has (default: the orchestrator's small files)
    into the Hub cache, at the revision's commit. ConfigError naming the repository and the fix where
    it cannot be reached, does not exist or is gated."""
    from huggingface_hub import snapshot_download

    quiet = _progress_class(lambda _n, _size: None)
    folder = _hub_call(ref, lambda: snapshot_download(ref.repo, revision=ref.revision, allow_patterns=list(names),
                                                      tqdm_class=quiet))
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"Hub model {ref} has no config.json: is it a transformers model repository?")
    return HubModel(ref, folder.name, folder)


def fetch(model: HubModel, names: Iterable[str], progress: FileProgress | None = None) -> list[Path]:
    """Fetch files of a resolved model (its safetensors shards) into the Hub cache; `progress` told
    the bytes as they come. The paths of the files, in the snapshot folder."""
    from huggingface_hub import hf_hub_download

    paths = []
    for name in names:
        tqdm_class = _progress_class(progress) if progress is not None else None
        path = _hub_call(model.ref, lambda name=name, cls=tqdm_class: hf_hub_download(
            model.ref.repo, name, revision=model.commit, tqdm_class=cls))
        paths.append(Path(path))
    return paths


def cached(model: HubModel, names: Iterable[str]) -> bool:
    """Whether the Hub cache holds every file of `names` at the model's commit (usable offline)."""
    from huggingface_hub import try_to_load_from_cache

    return all(isinstance(try_to_load_from_cache(model.ref.repo, name, revision=model.commit), str) for name in names)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_call(ref: HubRef, call: Callable[[], str]) -> str:
    """`call`'s result; its Hub errors as one ConfigError a user can act on."""
    from huggingface_hub import errors

    try:
        return call()
    except errors.GatedRepoError:
        raise ConfigError(f"Hub model {ref} is gated: accept its terms on the Hub and set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(f"Hub model {ref.repo} not found (or private: set HF_TOKEN); a local folder is taken "
                          "only where its path exists") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"Hub model {ref.repo} has no revision {ref.revision!r}") from None
    except errors.LocalEntryNotFoundError:
        raise ConfigError(f"Hub model {ref} is not in the Hub cache and the Hub cannot be reached (HF_HUB_OFFLINE "
                          "set, or no network): fetch it once online, or give a local folder") from None
    except (errors.HfHubHTTPError, OSError) as exc:
        raise ConfigError(f"Hub model {ref}: {exc}") from None


def _progress_class(progress: FileProgress) -> type:
    """A tqdm class that tells `progress` each update, and draws nothing."""
    from tqdm.auto import tqdm

    class Told(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            progress(int(n or 0), int(self.total or 0))
            return None

    return Told
