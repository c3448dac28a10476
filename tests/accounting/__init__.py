"""Tests of tf_twice.accounting."""
