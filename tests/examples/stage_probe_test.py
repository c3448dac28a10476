"""examples/stage_probe.py on digits, small: every row's stages, paired."""

from absl import flags

from examples import stage_probe


def _probe(rows):
    flag_values = flags.FlagValues()
    stage_probe.define_flags(flag_values)
    flag_values(['stage_probe', f'--rows={rows}', '--probe_steps=0',
                 '--draws=2', '--eval_examples=128', '--ranks=4',
                 '--public_examples=100', '--seeds=0',
                 '--target_epsilons=3'])
    return stage_probe.run_probes(flag_values)


def test_the_probe_measures_each_rows_stages_on_shared_batches(capsys):
    results = _probe('dpsgd q=q1,twice,hybrid unmasked')
    probe = results[0]
    assert set(probe) == {'dpsgd q=q1', 'twice', 'hybrid unmasked'}
    for row, by_stage in probe.items():
        assert [len(by_stage[s]) for s in ('clip', 'masks', 'noise')] == [
            2, 2, 2], row
        assert by_stage['noise'] != by_stage['masks'], row  # z > 0.
    # DP-SGD has no masks; twice sampling's change its update.
    dpsgd, twice = probe['dpsgd q=q1'], probe['twice']
    assert dpsgd['masks'] == dpsgd['clip']
    assert twice['masks'] != twice['clip']
    table = capsys.readouterr().out
    assert '| hybrid unmasked |' in table and 'lost to masks' in table
    # A row's numbers do not depend on the rows probed beside it (each
    # evaluation restores the probed weights before the next gradients).
    assert _probe('dpsgd q=q1')[0]['dpsgd q=q1'] == dpsgd
