"""Paths the tests read: the repository root and the files at its top."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
