"""Tests of tf_twice.sampling."""
