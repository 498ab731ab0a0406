"""kvprobe's home (``kvprobe.paths.home``) behind symbolic links: a link whose target does not exist yet has
its target created, as on a machine whose ``~/.cache`` is linked to a cache disk; a link that loops is one
line, not a traceback."""

import pytest

from kvprobe.errors import EnvironmentProblem
from kvprobe.paths import home


def test_a_home_linked_to_a_folder_not_yet_made_creates_the_folder(tmp_path, monkeypatch):
    target = tmp_path / "disk" / "kvprobe"
    link = tmp_path / "home-link"
    link.symlink_to(target)
    monkeypatch.setenv("KVPROBE_HOME", str(link))
    assert home() == link and target.is_dir() and link.is_dir()
    assert home() == link  # a second call finds it made


def test_a_cache_folder_linked_to_a_folder_not_yet_made_holds_the_default_home(tmp_path, monkeypatch):
    user = tmp_path / "user"
    user.mkdir()
    (user / ".cache").symlink_to(tmp_path / "cache-disk")
    monkeypatch.setenv("HOME", str(user))
    monkeypatch.delenv("KVPROBE_HOME", raising=False)
    assert home() == user / ".cache" / "kvprobe"
    assert (tmp_path / "cache-disk" / "kvprobe").is_dir()


def test_a_link_to_a_file_or_a_loop_is_one_line(tmp_path, monkeypatch):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder\n")
    to_file = tmp_path / "to-file"
    to_file.symlink_to(a_file)
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "loop")
    for link, needle in [(to_file, "is a file"), (loop, "cannot be created")]:
        monkeypatch.setenv("KVPROBE_HOME", str(link))
        with pytest.raises(EnvironmentProblem) as info:
            home()
        message = str(info.value)
        assert f"KVPROBE_HOME {link} {needle}" in message and "\n" not in message, message
        assert "set KVPROBE_HOME to a folder you can write" in message
