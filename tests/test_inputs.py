"""The one guard on every file a user names (rescue/core/inputs.py): a regular file of bounded size, or one
line; a FIFO never blocks the reader and /dev/zero is never read."""

from __future__ import annotations

import os
import re

import pytest

from rescue.core.configuration.config_files import ConfigError, load_config, read_toml
from rescue.core.inputs import InputFileError, read_input
from rescue.core.prompts import load_template
from rescue.service.settings import load_service_config

pytestmark = pytest.mark.fast


def test_a_regular_file_is_read_whole_within_its_bound(tmp_path):
    path = tmp_path / "a.toml"
    path.write_bytes(b"x" * 100)
    assert read_input(path, 100, "configuration file") == b"x" * 100
    with pytest.raises(InputFileError, match=r"a.toml: the file is 100 bytes long, at most 99$"):
        read_input(path, 99, "configuration file")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder", "missing"])
def test_every_reader_of_a_named_file_refuses_what_is_not_one(tmp_path, kind):
    bad = {"fifo": tmp_path / "x.txt", "dev-zero": "/dev/zero", "folder": tmp_path / "d.txt",
           "missing": tmp_path / "none.txt"}[kind]
    if kind == "fifo":
        os.mkfifo(bad)  # nobody writes: a blocking reader would hang here
    if kind == "folder":
        bad.mkdir()
    said = {"fifo": "is a FIFO (named pipe), not a file", "dev-zero": "is a character device, not a file",
            "folder": "is a folder, not a file", "missing": "cannot read: no such"}[kind]
    for call, error in ((lambda: load_config(bad), ConfigError), (lambda: load_service_config(bad), ConfigError),
                        (lambda: read_toml(bad, "configuration file"), ConfigError)):
        with pytest.raises(error) as info:
            call()
        assert str(info.value).startswith(f"{bad}: ") and said in str(info.value) and "\n" not in str(info.value)
    if kind != "dev-zero":
        with pytest.raises(InputFileError, match=re.escape(said)):
            load_template(bad.stem, bad.parent)


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes(b"[vlm]\nmodel = '\xff'\n")
    with pytest.raises(ConfigError, match=r"c.toml: not UTF-8 text \(invalid start byte at byte 15\)"):
        load_config(path)
