"""Tests of tf_twice.hybrid."""
