"""Tests of tf_twice.mechanism."""
