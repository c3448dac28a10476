"""Tests of tf_twice: folders mirror the package; shared helpers at this level."""
