"""What the tests share (conftest.py holds the fixtures and hooks): paths, processes, runs of the entry point,
layout groups, corpora. The scripts the tests start run from tests/workers/."""
