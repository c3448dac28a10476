"""Packaging for tf_twice.

The pins below are the set that installs and imports together on Python 3.11:

* TensorFlow 2.15 is the last release whose Keras is Keras 2; tensorflow-privacy
  0.9.0 subclasses Keras 2 (legacy) optimizers and fails to import with Keras 3.
  TensorFlow 2.15 also needs numpy < 2 and protobuf < 5.
* tensorflow-privacy 0.9.0 itself pins dp-accounting 0.4.3; it is repeated here
  because tf_twice.accounting builds on dp_accounting directly.
* tensorflow-datasets depends on tensorflow-metadata without a version bound,
  and the newest tensorflow-metadata ships protobuf-6 generated code that fails
  at import under protobuf 4. tensorflow-metadata 1.17.2 is generated with
  protobuf 4.25 and imports under TensorFlow 2.15's protobuf.
"""

import setuptools

INSTALL_REQUIRES = [
    'tensorflow==2.15.1',
    'tensorflow-privacy==0.9.0',
    'dp-accounting==0.4.3',
    'numpy>=1.23.5,<2',
    'scipy>=1.9,<2',
    'absl-py>=1.0,<2',
    'attrs>=22.2',
    'scikit-learn>=1.0,<2',
    'tensorflow-datasets==4.9.9',
    'tensorflow-metadata==1.17.2',
    'protobuf>=4.25.2,<5',
]

EXTRAS_REQUIRE = {
    'test': [
        'pytest>=8',
        'pytest-xdist>=3.5',
        'mpmath>=1.3',
        'matplotlib>=3.7',  # The reproduction tests draw the figures.
    ],
    'examples': [
        'matplotlib>=3.7',
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
    python_requires='>=3.11,<3.12',
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    classifiers=[
        'Programming Language :: Python :: 3.11',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
        'Topic :: Security',
    ],
)
