"""Packaging for tf_twice.

The ranges below are the ones installed and tested (see docs/setup.md,
"Supported versions"): Python 3.10 to 3.13, TensorFlow 2.15.1 to 2.21.x.

* TensorFlow 2.15 is the last release whose Keras is Keras 2; from 2.16 on
  tf.keras is Keras 3, or Keras 2 with the tf-keras package and
  TF_USE_LEGACY_KERAS=1. TensorFlow itself bounds numpy (< 2 for 2.15) and
  protobuf (< 5 for 2.15, >= 6.31 for 2.20+); the bounds here are the span
  the tests ran on.
* TensorFlow 2.20+ no longer installs tensorboard; the privacy ledger writes
  TensorBoard logs, so it is a dependency.
* dp-accounting: tested with 0.4.3 (what tensorflow-privacy pins) and 0.6.0.
* tensorflow-privacy is optional (the `tf-privacy` extra): only the optimizer
  classes in tf_twice.optimizers derive from it, and they need Keras 2.
  Its last release, 0.9.0, installs on Python < 3.12 only, so the extra is
  empty on 3.12+. It pins tensorflow 2.15 as well: tensorflow-privacy accepts
  any TensorFlow 2, with which pip would pick the newest (Keras 3, where its
  optimizers do not work).
* tensorflow-datasets serves only the training script's tfds datasets
  (imported there lazily) and their tests, so it is in the `examples` and
  `test` extras. It depends on tensorflow-metadata without a bound, and
  tensorflow-metadata 1.21 ships protobuf-6 generated code that fails at
  import under protobuf 4 and 5 (TensorFlow 2.15's); 1.17.2 and 1.17.3 import
  under protobuf 4.25 to 7, and 1.17.3 also installs on Python 3.10 next to
  protobuf 6.
* kymatio (the `features` extra, also in `examples` and `test`) computes the
  ScatterNet features of tf_twice.features. Its last release, 0.3.0, imports
  scipy's sph_harm, which scipy 1.17 removed; tf_twice.features defines it
  from sph_harm_y before importing kymatio.
"""

import setuptools

INSTALL_REQUIRES = [
    'tensorflow>=2.15.1,<2.22',
    'tensorboard>=2.15,<2.22',
    'dp-accounting>=0.4.3,<0.7',
    'numpy>=1.23.5,<3',
    'protobuf>=4.25.2,<8',
    'scipy>=1.9,<2',
    'absl-py>=1.0,<3',
    'attrs>=22.2',
    'scikit-learn>=1.0,<2',  # The training script's default dataset.
]

# kymatio's Scattering2D for the ScatterNet features (tf_twice.features); 0.3.0
# is its last release (tf_twice.features shims its scipy import).
_KYMATIO = ['kymatio==0.3.0']

# tensorflow-datasets and the tensorflow-metadata that imports under every
# supported protobuf (see the module docstring).
_TFDS = [
    'tensorflow-datasets>=4.9.9,<4.10',
    'tensorflow-metadata>=1.17.2,<1.18',
]

EXTRAS_REQUIRE = {
    'test': [
        'pytest>=8',
        'pytest-xdist>=3.5',
        'mpmath>=1.3',
        'matplotlib>=3.7',  # The reproduction tests draw the figures.
    ] + _TFDS + _KYMATIO,
    'examples': [
        'matplotlib>=3.7',
    ] + _TFDS + _KYMATIO,
    # The ScatterNet features of tf_twice.features (see _KYMATIO).
    'features': _KYMATIO,
    # The optimizer classes of tf_twice.optimizers: tensorflow-privacy on
    # the last TensorFlow with Keras 2.
    'tf-privacy': [
        'tensorflow-privacy==0.9.0; python_version < "3.12"',
        'tensorflow>=2.15.1,<2.16; python_version < "3.12"',
    ],
}

setuptools.setup(
    name='tf_twice',
    version='0.1.0',
    description=(
        'DP-SGD with twice sampling and hybrid clipping, and its exact RDP '
        'accounting, as an extension of TensorFlow Privacy.'
    ),
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    packages=setuptools.find_packages(include=['tf_twice', 'tf_twice.*']),
    python_requires='>=3.10,<3.14',
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    classifiers=[
        'Programming Language :: Python :: 3.10',
        'Programming Language :: Python :: 3.11',
        'Programming Language :: Python :: 3.12',
        'Programming Language :: Python :: 3.13',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
        'Topic :: Security',
    ],
)
