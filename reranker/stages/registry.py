"""Stage discovery through the `diffusion_gr2.stages` entry-point group.

Nothing is imported at module import time; a stage's module is imported when it is first
asked for. The only state is a cache of loaded stage classes. A name missing from the cache
triggers a fresh scan, so a distribution that appears on sys.path after the first lookup
(a plugin installed into a running session, or a test's temporary site dir) is still found.
"""
from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

GROUP = "diffusion_gr2.stages"

_loaded: dict[str, type] = {}  # the cache: stage name -> class


class UnknownStageError(KeyError):
    def __str__(self):  # KeyError's str() would wrap the message in quotes
        return str(self.args[0])


def _scan() -> dict[str, list[EntryPoint]]:
    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=GROUP):
        eps = found.setdefault(ep.name, [])
        if all(e.value != ep.value for e in eps):  # the same dist seen twice on sys.path is not a clash
            eps.append(ep)
    return found


def available_stages() -> list[str]:
    """Names of every registered stage (sorted)."""
    return sorted(_scan())


def get_stage_class(name: str) -> type:
    if name in _loaded:
        return _loaded[name]
    found = _scan()
    if name not in found:
        names = ", ".join(sorted(found)) or "none (is the project installed? `pip install -e .`)"
        raise UnknownStageError(f"unknown training stage {name!r}; registered stages ({GROUP}): {names}")
    if len(found[name]) > 1:
        raise RuntimeError(f"stage {name!r} is registered more than once: "
                           + ", ".join(ep.value for ep in found[name]))
    obj = found[name][0].load()
    if not isinstance(obj, type) or not callable(getattr(obj, "run", None)):
        raise TypeError(f"entry point {name!r} = {found[name][0].value} is not a stage class (needs a run method)")
    _loaded[name] = obj
    return obj


def get_stage(name: str):
    """A fresh instance of the stage registered under `name`.

    Raises UnknownStageError (a KeyError) naming the registered stages when `name` is unknown."""
    stage = get_stage_class(name)()
    if not getattr(stage, "name", None):
        stage.name = name
    return stage
