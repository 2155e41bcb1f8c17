import pytest

from megatron_ru.parallel.hostlist import expand_hostlist, first_host, main


@pytest.mark.parametrize("text, expected", [
    ("node01", ["node01"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a[1-2],b3", ["a1", "a2", "b3"]),
    ("gpu-[001-004]", ["gpu-001", "gpu-002", "gpu-003", "gpu-004"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),            # no padding when the lower bound has none
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),         # padding follows the lower bound
    ("x[3],y[5-6],z", ["x3", "y5", "y6", "z"]),
    ("a[1-2]b", ["a1b", "a2b"]),
    ("g0001,g0003", ["g0001", "g0003"]),
])
def test_expand_like_scontrol(text, expected):
    assert expand_hostlist(text) == expected
    assert first_host(text) == expected[0]


@pytest.mark.parametrize("text, message", [
    ("node[01-03", "unclosed '['"),
    ("node01-03]", "unmatched ']'"),
    ("node[a-b]", "bad range 'a-b'"),
    ("node[05-01]", "descending range '05-01'"),
    ("node[[1-2]]", "nested '['"),
    ("", "empty node list"),
])
def test_bad_node_lists_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        expand_hostlist(text)


def test_command_prints_one_host_per_line(capsys):
    """`python -m megatron_ru.parallel.hostlist NODELIST`: what `scontrol show hostnames` prints
    (the Slurm job scripts use it where scontrol is missing or unconfigured)."""
    assert main(["gpu-[001-002],cpu07"]) == 0
    assert capsys.readouterr().out == "gpu-001\ngpu-002\ncpu07\n"
    assert main(["node[05-01]"]) == 2
    assert "cannot expand the node list 'node[05-01]': descending range '05-01'" in capsys.readouterr().err
    assert main([]) == 2
    assert "usage: python -m megatron_ru.parallel.hostlist NODELIST" in capsys.readouterr().err
