"""Tests of tf_twice's examples/ scripts."""
