"""Published recipes: the training script's defaults per dataset and features.

A user who names a dataset gets the best published recipe for it, not the
digits one: `--dataset=fashion_mnist` runs Tramer & Boneh's end-to-end tanh
CNN, and `--dataset=fashion_mnist --features=scattering` their ScatterNet +
linear model ("Differentially Private Learning Needs Better Features (or
Much More Data)", ICLR 2021, arXiv:2011.11660, Table 1 and Appendix B: 86.0
% and 89.7 % test accuracy at epsilon = 3, delta = 1e-5). Every other
dataset takes the digits recipe. Each setting of a recipe is only a default:
the flag of the same name overrides it, and `describe` prints the recipe in
force with the flags that overrode it.

Epochs are 1 / q1 steps rounded (`tf_twice.TwiceSamplingConfig.
steps_per_epoch`): 40 epochs at an expected batch of 8,192 out of 60,000
are 40 * 7 = 280 steps, and of 2,048 are 40 * 29 = 1,160, the published
counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence

__all__ = ['FEATURES', 'Recipe', 'RECIPES', 'apply', 'describe', 'recipe_for']

# --features: none (the images themselves) or scattering (tf_twice.features:
# ScatterNet coefficients, computed once and cached on disk).
FEATURES = ('none', 'scattering')


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Defaults of the flags of the same names."""

    name: str
    mode: str
    model: str
    batch_size: float
    epochs: float
    learning_rate: float
    momentum: float
    l2_norm_clip: float
    target_epsilon: float
    physical_batch_size: int

    # Filled into the config by `apply`; batch_size, epochs and
    # target_epsilon are read by the plan, which knows n (the batch is
    # capped at it) and whether --steps or --noise_multiplier replaces them.
    FILLED = ('mode', 'model', 'learning_rate', 'momentum', 'l2_norm_clip',
              'physical_batch_size')
    # The flags that replace a recipe setting when given instead of it.
    ALTERNATIVES = {'batch_size': 'example_sampling_rate', 'epochs': 'steps',
                    'target_epsilon': 'noise_multiplier'}

    def settings(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name)
                for f in dataclasses.fields(self) if f.name != 'name'}


DIGITS = Recipe(
    name='twice sampling on digits (this library\'s small-data default)',
    mode='twice', model='small_cnn', batch_size=128, epochs=40,
    learning_rate=0.5, momentum=0.0, l2_norm_clip=1.0, target_epsilon=4.0,
    physical_batch_size=64)
FASHION_MNIST_END_TO_END = Recipe(
    name='Tramer & Boneh (ICLR 2021), end-to-end tanh CNN, DP-SGD',
    mode='dpsgd', model='tanh_cnn', batch_size=2048, epochs=40,
    learning_rate=4.0, momentum=0.9, l2_norm_clip=0.1, target_epsilon=3.0,
    physical_batch_size=64)
FASHION_MNIST_SCATTERNET = Recipe(
    name='Tramer & Boneh (ICLR 2021), ScatterNet + linear, DP-SGD',
    mode='dpsgd', model='linear', batch_size=8192, epochs=40,
    learning_rate=16.0, momentum=0.9, l2_norm_clip=0.1, target_epsilon=3.0,
    # A linear model's per-example gradients are small: larger chunks are
    # faster (512 beat 128 on 2 cores).
    physical_batch_size=512)

# (dataset, features) -> recipe; missing pairs take the digits recipe.
RECIPES = {
    ('fashion_mnist', 'none'): FASHION_MNIST_END_TO_END,
    ('fashion_mnist', 'scattering'): FASHION_MNIST_SCATTERNET,
}


def recipe_for(dataset: str, features: str) -> Recipe:
    return RECIPES.get((dataset, features), DIGITS)


def apply(config: Any) -> Recipe:
    """Fills the config's unset (None) `Recipe.FILLED` flags from its
    recipe; returns the recipe."""
    recipe = recipe_for(config.dataset, config.features)
    for name in Recipe.FILLED:
        if getattr(config, name) is None:
            setattr(config, name, getattr(recipe, name))
    return recipe


def describe(recipe: Recipe, given: Sequence[str],
             mode: Optional[str] = None) -> str:
    """The recipe as flags, and the flags given that override it.

    `given`: names of the flags set by the user (not from the recipe).
    `mode`: the run's mode; a nonprivate run has no target epsilon.
    """
    parts = []
    for name, value in recipe.settings().items():
        if name == 'target_epsilon' and mode == 'nonprivate':
            continue
        parts.append(f'--{name}={value:g}' if isinstance(value, float)
                     else f'--{name}={value}')
    text = f'Recipe: {recipe.name}: ' + ' '.join(parts) + '.'
    overridden = sorted(
        {name for name in recipe.settings() if name in given}
        | {alt for alt in Recipe.ALTERNATIVES.values() if alt in given})
    if overridden:
        text += ' Overridden: ' + ', '.join(f'--{n}' for n in overridden) + '.'
    return text
