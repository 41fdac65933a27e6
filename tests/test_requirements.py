"""The template's install: requirements-lock.txt, which `make` installs first, fits the pins."""

from importlib.metadata import requires

from conftest import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def lock() -> dict[str, str]:
    """requirements-lock.txt as {canonical name: version}; every line pins one exact version."""
    pinned = {}
    for line in (ROOT / "requirements-lock.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == "==" and not requirement.marker, line
            pinned[canonicalize_name(requirement.name)] = specifier.version
    return pinned


def pins() -> list[Requirement]:
    """requirements-dev.txt's requirements that apply to this Python."""
    found = []
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            requirement = Requirement(line)
            if not requirement.marker or requirement.marker.evaluate():
                found.append(requirement)
    return found


def test_the_lock_pins_every_requirement_at_its_pinned_version():
    """Each requirements-dev.txt pin is in the lock at that version (a stale lock still installs:
    make then resolves requirements-dev.txt, but slowly)."""
    locked = lock()
    for requirement in pins():
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{name} is not in requirements-lock.txt: run make lock"
        assert requirement.specifier.contains(locked[name]), f"{locked[name]} locked: {requirement}"


def test_the_lock_holds_everything_the_pins_pull_in():
    """The lock's parts install without resolving (pip --no-deps), so every package the pins
    require, with the extras they ask for (torch's CUDA libraries come as cuda-toolkit's), down to
    the last dependency, is in it at a version the requirer accepts; this venv's metadata says."""
    locked = lock()
    todo = [(requirement, "requirements-dev.txt") for requirement in pins()]
    seen = set()
    while todo:
        requirement, by = todo.pop()
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{requirement} (for {by}) is not in requirements-lock.txt"
        assert requirement.specifier.contains(locked[name], prereleases=True), (requirement, by)
        for extra in {""} | requirement.extras:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for line in requires(name) or []:
                needed = Requirement(line)
                if not needed.marker or needed.marker.evaluate({"extra": extra}):
                    todo.append((needed, name))
