r"""Prints the privacy statement of twice-sampled DP-SGD.

The twice-sampling counterpart of tf_privacy's `compute_dp_sgd_privacy`
command, with the same flags plus the coordinate sampling rate and the clip
norms. Example (a CIFAR-10 sized run):

  python -m tf_twice.compute_privacy --N=50000 --batch_size=1000 \
      --noise_multiplier=1.2 --epochs=50 --delta=1e-5 \
      --coordinate_sampling_rate=0.5 --l2_norm_clip=1.0 --linf_norm_clip=0.1

Several hybrid-clipping blocks: give comma-separated lists of equal length
for --noise_multiplier, --l2_norm_clip and --linf_norm_clip, and for
--coordinate_sampling_rate one rate per block (hybrid clipping's principal
blocks keep every coordinate by default: rate 1, then the residual's q2).
With several blocks a single rate is refused unless it is 1 (no masks):
a rate below 1 for every block would state the paper's all-masked plan, whose
epsilon is smaller than that of a default plan.
"""

from absl import app
from absl import flags

from tf_twice.accounting import statement

_N = flags.DEFINE_integer('N', None, 'Total number of training examples.')
_BATCH_SIZE = flags.DEFINE_float(
    'batch_size', None, 'Expected examples per step (Poisson rate q1 = '
    'batch_size / N).')
_NOISE_MULTIPLIER = flags.DEFINE_list(
    'noise_multiplier', None, 'Noise multiplier(s): one, or one per block.')
_EPOCHS = flags.DEFINE_float('epochs', None, 'Number of epochs (may be '
                             'fractional); steps = ceil(epochs * N / '
                             'batch_size).')
_DELTA = flags.DEFINE_float('delta', 1e-5, 'Target delta.')
_COORDINATE_SAMPLING_RATE = flags.DEFINE_list(
    'coordinate_sampling_rate', ['1.0'], 'q2: probability of keeping each '
    'coordinate of each sampled example: one, or one per block.')
_L2_NORM_CLIP = flags.DEFINE_list('l2_norm_clip', ['1.0'],
                                  'l2 clip norm(s): one, or one per block.')
_LINF_NORM_CLIP = flags.DEFINE_list(
    'linf_norm_clip', ['none'], 'l-infinity clip norm(s), or "none".')
_USED_MICROBATCHING = flags.DEFINE_boolean(
    'used_microbatching', False, 'Kept for tf_privacy compatibility; must be '
    'false (the analysis assumes per-example clipping).')
_CONVERSION = flags.DEFINE_enum(
    'conversion', 'dp_accounting', ['dp_accounting', 'basic'],
    'RDP to (epsilon, delta) conversion; "basic" reproduces the paper.')

flags.mark_flags_as_required(['N', 'batch_size', 'noise_multiplier',
                              'epochs'])


def _numbers(flag_name: str, values, allow_none: bool = False):
    parsed = []
    for value in values:
        if allow_none and value.strip().lower() == 'none':
            parsed.append(None)
            continue
        try:
            parsed.append(float(value))
        except ValueError:
            raise app.UsageError(f'--{flag_name} must be numbers'
                                 f'{" or none" if allow_none else ""}; got '
                                 f'{value!r}.') from None
    return parsed[0] if len(parsed) == 1 else tuple(parsed)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
    rates = _numbers('coordinate_sampling_rate',
                     _COORDINATE_SAMPLING_RATE.value)
    num_blocks = max(len(values) for values in (
        _NOISE_MULTIPLIER.value, _L2_NORM_CLIP.value, _LINF_NORM_CLIP.value))
    if num_blocks > 1 and not isinstance(rates, tuple) and rates != 1:
        raise app.UsageError(
            f'--coordinate_sampling_rate must give one rate per block '
            f'({num_blocks}) when it is below 1, e.g. '
            f'{",".join(["1"] * (num_blocks - 1) + [f"{rates:g}"])} for '
            'hybrid clipping\'s default (principal blocks unmasked); got the '
            f'single rate {rates:g}.')
    try:
        text = statement.compute_twice_sampling_privacy_statement(
            number_of_examples=_N.value,
            batch_size=_BATCH_SIZE.value,
            num_epochs=_EPOCHS.value,
            noise_multiplier=_numbers('noise_multiplier',
                                      _NOISE_MULTIPLIER.value),
            delta=_DELTA.value,
            coordinate_sampling_rate=rates,
            l2_norm_clip=_numbers('l2_norm_clip', _L2_NORM_CLIP.value),
            linf_norm_clip=_numbers('linf_norm_clip', _LINF_NORM_CLIP.value,
                                    allow_none=True),
            used_microbatching=_USED_MICROBATCHING.value,
            conversion=_CONVERSION.value)
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    print(text)


if __name__ == '__main__':
    app.run(main)
