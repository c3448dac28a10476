"""Tests of tf_twice.keras."""
