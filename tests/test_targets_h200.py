"""The H200's (cuda:90) check of tests/test_targets.py, in a file of its own: its list is the longest (the w8a8 path,
the persistent TMA kernels, PDL) and takes most of a test file's time budget alone."""

from test_targets import compile_check


def test_every_launch_compiles_for_the_h200(tmp_path):
    compile_check("h200", tmp_path)
