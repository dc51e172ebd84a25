"""Unit tests for elasticrun.common.hosts: host entries, discovery output, -H and hostfiles."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.common.hosts import (
    MAX_HOSTS,
    MAX_KEPT_PROBLEMS,
    MAX_SLOTS_PER_HOST,
    HostList,
    HostSpecError,
    parse_discovery_output,
    parse_host_entry,
    parse_hostfile,
    parse_hosts_arg,
)

pytestmark = pytest.mark.timeout(60)

# Valid host names: a label of letters/digits (plus inner '.', '-', '_'), optional user@.
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_label = st.text(alphabet=_ALNUM, min_size=1, max_size=6)
host_names = st.builds(
    lambda user, parts: (f"{user}@" if user else "") + ".".join(parts),
    st.one_of(st.none(), _label),
    st.lists(_label, min_size=1, max_size=3),
)
slot_counts = st.integers(min_value=1, max_value=64)


# --- parse_host_entry ------------------------------------------------------------------------
class TestParseHostEntry:
    @pytest.mark.parametrize(
        "text, default, expected",
        [
            ("node1", 1, ("node1", 1)),
            ("node1", 4, ("node1", 4)),
            ("node1:3", 1, ("node1", 3)),
            ("  node1:3  ", 1, ("node1", 3)),
            ("10.0.0.7:8", 2, ("10.0.0.7", 8)),
            ("gpu-01.cluster.local:2", 1, ("gpu-01.cluster.local", 2)),
            ("under_score", 1, ("under_score", 1)),
            ("alice@node1", 2, ("alice@node1", 2)),
            ("alice@node1:5", 2, ("alice@node1", 5)),
            ("x", 1, ("x", 1)),
        ],
    )
    def test_valid(self, text, default, expected):
        assert parse_host_entry(text, default) == expected

    @pytest.mark.parametrize("text", ["", "   ", "\t"])
    def test_empty_entry(self, text):
        with pytest.raises(HostSpecError, match="empty host entry"):
            parse_host_entry(text, 1)

    @pytest.mark.parametrize("text, bad", [("node:x", "'x'"), ("node:", "''"), ("node:2.5", "'2.5'"),
                                           ("node:two", "'two'")])
    def test_non_integer_slots(self, text, bad):
        with pytest.raises(HostSpecError) as err:
            parse_host_entry(text, 1)
        message = str(err.value)
        assert "not a whole number" in message
        assert bad in message
        assert repr(text) in message

    @pytest.mark.parametrize("text, got", [("node:0", "got 0"), ("node:-3", "got -3")])
    def test_too_few_slots(self, text, got):
        with pytest.raises(HostSpecError, match="at least 1 slot") as err:
            parse_host_entry(text, 1)
        assert got in str(err.value)
        assert repr(text) in str(err.value)

    def test_zero_default_slots_is_rejected_too(self):
        with pytest.raises(HostSpecError, match="at least 1 slot"):
            parse_host_entry("node", 0)

    @pytest.mark.parametrize("text", [":3", "bad host", "node!", "-node", "node.", "node-", "@node",
                                      "a@b@c", "a:b:3", "[::1]:2", "no/de", "user@:2",
                                      # a part the resolver refuses (it raised UnicodeError in the driver)
                                      "node1..cluster:1", "u@a..b", "x" * 64 + ".example.com:2"])
    def test_invalid_host_name(self, text):
        with pytest.raises(HostSpecError, match="not a valid host name") as err:
            parse_host_entry(text, 1)
        assert repr(text.strip()) in str(err.value)

    @pytest.mark.parametrize("text", ["node:99999999999999999999", f"node:{MAX_SLOTS_PER_HOST + 1}"])
    def test_absurd_slot_counts_rejected(self, text):
        with pytest.raises(HostSpecError, match=f"a host has at most {MAX_SLOTS_PER_HOST} slots") as err:
            parse_host_entry(text, 1)
        assert repr(text) in str(err.value)

    def test_the_limit_itself_is_accepted(self):
        assert parse_host_entry(f"node:{MAX_SLOTS_PER_HOST}", 1) == ("node", MAX_SLOTS_PER_HOST)
        with pytest.raises(HostSpecError, match="at most"):
            parse_host_entry("node", MAX_SLOTS_PER_HOST + 1)

    def test_a_huge_entry_is_cut_short_in_the_message(self):
        for text in ("x" * 1_000_000 + "!", "node:" + "9" * 4000, "node:" + "x" * 100_000):
            with pytest.raises(HostSpecError) as err:
                parse_host_entry(text, 1)
            assert len(str(err.value)) < 250, str(err.value)[:300]

    def test_host_names_longer_than_dns_allows_are_rejected(self):
        longest = ".".join(["a" * 63] * 3 + ["a" * 61])  # 253 characters
        assert parse_host_entry(longest, 1) == (longest, 1)
        assert parse_host_entry("u" * 64 + "@" + longest, 1)[0].startswith("u")
        for text in ("a" * 254, "u" * 65 + "@a"):
            with pytest.raises(HostSpecError, match="host name too long"):
                parse_host_entry(text, 1)

    def test_error_is_a_value_error(self):
        assert issubclass(HostSpecError, ValueError)

    @given(host=host_names, slots=slot_counts, default=slot_counts)
    def test_round_trip_property(self, host, slots, default):
        assert parse_host_entry(f"{host}:{slots}", default) == (host, slots)
        assert parse_host_entry(host, default) == (host, default)
        assert parse_host_entry(f"  {host}:{slots}\t", default) == (host, slots)

    @given(host=host_names, slots=st.integers(max_value=0))
    def test_non_positive_slots_always_rejected(self, host, slots):
        with pytest.raises(HostSpecError, match="at least 1 slot"):
            parse_host_entry(f"{host}:{slots}", 1)


# --- HostList.add ----------------------------------------------------------------------------
class TestHostList:
    def test_same_slots_twice_merges_silently(self):
        hl = HostList()
        hl.add("a", 2, "x")
        hl.add("a", 2, "y")
        assert hl.hosts == {"a": 2}
        assert hl.warnings == []

    def test_different_slots_keep_max_and_warn(self):
        hl = HostList()
        hl.add("a", 4, "first")
        hl.add("a", 2, "second")
        assert hl.hosts == {"a": 4}
        assert len(hl.warnings) == 1
        assert "second" in hl.warnings[0] and "'a'" in hl.warnings[0] and "using 4" in hl.warnings[0]


# --- parse_discovery_output ------------------------------------------------------------------
class TestParseDiscoveryOutput:
    def test_basic(self):
        result = parse_discovery_output("a:2\nb\nc:4\n", default_slots=3)
        assert result.hosts == {"a": 2, "b": 3, "c": 4}
        assert list(result.hosts) == ["a", "b", "c"]  # order first listed
        assert result.errors == [] and result.warnings == []

    def test_empty_output(self):
        result = parse_discovery_output("", 1)
        assert result.hosts == {} and result.errors == [] and result.warnings == []

    def test_blank_lines_and_comments_ignored(self):
        text = "\n# a comment\n   \na:2   # trailing comment\n\t\n#b:3\nc\n"
        result = parse_discovery_output(text, 1)
        assert result.hosts == {"a": 2, "c": 1}
        assert result.errors == []

    def test_crlf_line_endings(self):
        result = parse_discovery_output("a:2\r\nb:1\r\n", 1)
        assert result.hosts == {"a": 2, "b": 1}
        assert result.errors == []

    def test_a_byte_order_mark_at_the_start_is_not_part_of_the_first_host(self):
        """A hosts file saved as UTF-8 by an editor on Windows, which a script cats."""
        result = parse_discovery_output("\ufeffa:2\r\nb:1\r\n", 1)
        assert result.hosts == {"a": 2, "b": 1} and result.errors == []
        later = parse_discovery_output("a:2\n\ufeffb:1\n", 1)  # (anywhere else it is a bad name, named)
        assert later.hosts == {"a": 2} and "line 2: '\\ufeffb:1'" in later.errors[0]

    def test_invalid_lines_reported_with_number_and_text_and_skipped(self):
        text = "a:2\nb:x\n\nc:0\nbad host\nd:1\n"
        result = parse_discovery_output(text, 1)
        assert result.hosts == {"a": 2, "d": 1}
        assert len(result.errors) == 3
        assert result.errors[0].startswith("line 2:") and "'b:x'" in result.errors[0]
        assert "not a whole number" in result.errors[0]
        assert result.errors[1].startswith("line 4:") and "'c:0'" in result.errors[1]
        assert "at least 1 slot" in result.errors[1]
        assert result.errors[2].startswith("line 5:") and "'bad host'" in result.errors[2]

    def test_zero_slots_invalid(self):
        result = parse_discovery_output("a:0\n", 1)
        assert result.hosts == {}
        assert len(result.errors) == 1 and "line 1" in result.errors[0]

    def test_duplicates_merged_with_max_slots_and_warning(self):
        result = parse_discovery_output("a:2\nb:1\na:4\na:3\n", 1)
        assert result.hosts == {"a": 4, "b": 1}
        assert list(result.hosts) == ["a", "b"]  # first-listed position kept
        assert len(result.warnings) == 2
        assert result.warnings[0].startswith("line 3:") and "'a'" in result.warnings[0]
        assert "using 4" in result.warnings[0]
        assert result.warnings[1].startswith("line 4:") and "using 4" in result.warnings[1]

    def test_identical_duplicate_no_warning(self):
        result = parse_discovery_output("a:2\na:2\n", 1)
        assert result.hosts == {"a": 2}
        assert result.warnings == []

    def test_duplicate_via_default_slots(self):
        result = parse_discovery_output("a\na:5\n", 2)
        assert result.hosts == {"a": 5}
        assert len(result.warnings) == 1

    def test_user_at_host_allowed(self):
        result = parse_discovery_output("alice@node1:2\nbob@node2\n", 1)
        assert result.hosts == {"alice@node1": 2, "bob@node2": 1}
        assert result.errors == []

    def test_absurd_slot_count_is_an_invalid_line(self):
        result = parse_discovery_output("a:2\nb:99999999999999999999\nc:1\n", 1)
        assert result.hosts == {"a": 2, "c": 1}
        assert len(result.errors) == 1 and result.errors[0].startswith("line 2:") and "at most" in result.errors[0]

    def test_many_problems_are_counted_not_kept(self):
        text = "good:1\n" + "bad host\n" * 100_000 + "".join(f"dup:{i + 1}\n" for i in range(1000))
        result = parse_discovery_output(text, 1)
        assert result.hosts == {"good": 1, "dup": 1000}
        assert len(result.errors) == MAX_KEPT_PROBLEMS and result.more_errors == 100_000 - MAX_KEPT_PROBLEMS
        assert len(result.warnings) == MAX_KEPT_PROBLEMS and result.more_warnings == 999 - MAX_KEPT_PROBLEMS
        assert result.errors[0].startswith("line 2:")

    def test_error_does_not_hide_later_good_lines(self):
        result = parse_discovery_output("!!!\n" * 5 + "good:3\n", 1)
        assert result.hosts == {"good": 3}
        assert [e.split(":")[0] for e in result.errors] == [f"line {i}" for i in range(1, 6)]

    @given(
        entries=st.lists(st.tuples(host_names, st.one_of(st.none(), slot_counts)), max_size=12),
        default=slot_counts,
        junk=st.lists(st.sampled_from(["", "   ", "# comment", "#x:3", "\t# c"]), max_size=5),
    )
    @settings(max_examples=200)
    def test_property_matches_model(self, entries, default, junk):
        lines = [h if s is None else f"{h}:{s}" for h, s in entries] + list(junk)
        result = parse_discovery_output("\n".join(lines), default)
        expected: dict[str, int] = {}
        for h, s in entries:
            n = default if s is None else s
            expected[h] = max(n, expected.get(h, 0))
        assert result.hosts == expected
        assert list(result.hosts) == list(dict.fromkeys(h for h, _ in entries))
        assert result.errors == []

    @given(
        good=st.lists(st.tuples(host_names, slot_counts), max_size=6),
        bad=st.lists(st.sampled_from(["a:0", "b:x", "bad host", "c:-1", "d:1.5", "e:"]), max_size=6),
        data=st.data(),
    )
    @settings(max_examples=100)
    def test_property_bad_lines_counted(self, good, bad, data):
        lines = [f"{h}:{s}" for h, s in good] + bad
        lines = data.draw(st.permutations(lines))
        result = parse_discovery_output("\n".join(lines), 1)
        assert len(result.errors) == len(bad)
        bad_numbers = [i for i, line in enumerate(lines, start=1) if line in bad]
        assert [e.split(":")[0] for e in result.errors] == [f"line {i}" for i in bad_numbers]
        assert set(result.hosts) == {h for h, _ in good}


# --- parse_hosts_arg -------------------------------------------------------------------------
class TestParseHostsArg:
    def test_basic(self):
        assert parse_hosts_arg("a:2,b,c:3", 4) == {"a": 2, "b": 4, "c": 3}

    def test_spaces_around_entries(self):
        assert parse_hosts_arg(" a:2 , b ", 1) == {"a": 2, "b": 1}

    def test_single_host(self):
        assert parse_hosts_arg("localhost", 2) == {"localhost": 2}

    def test_user_at_host(self):
        assert parse_hosts_arg("root@a:2,b", 1) == {"root@a": 2, "b": 1}

    @pytest.mark.parametrize("spec", ["localhost:1,localhost:2", "a:2,b,a:2", "a,a"])
    def test_a_host_listed_twice_is_refused(self, spec):
        with pytest.raises(HostSpecError, match=r"^-H .*: host '(localhost|a)' is listed twice$"):
            parse_hosts_arg(spec, 1)

    @pytest.mark.parametrize("spec", ["localhost:99999999999999999999", f"a:1,b:{MAX_SLOTS_PER_HOST + 1}"])
    def test_absurd_slot_counts_are_refused(self, spec):
        with pytest.raises(HostSpecError, match=f"a host has at most {MAX_SLOTS_PER_HOST} slots"):
            parse_hosts_arg(spec, 1)

    def test_too_many_hosts(self):
        spec = ",".join(f"h{i}" for i in range(MAX_HOSTS + 1))
        with pytest.raises(HostSpecError) as err:
            parse_hosts_arg(spec, 1)
        assert f"more than the {MAX_HOSTS:,} allowed" in str(err.value) and len(str(err.value)) < 200
        assert len(parse_hosts_arg(spec.rpartition(",")[0], 1)) == MAX_HOSTS

    def test_a_long_spec_is_cut_short_in_messages(self):
        spec = ",".join(f"host{i}" for i in range(5000)) + ",host7"
        with pytest.raises(HostSpecError) as err:
            parse_hosts_arg(spec, 1)
        assert "host 'host7' is listed twice" in str(err.value) and len(str(err.value)) < 200

    @pytest.mark.parametrize("spec", ["a:2,b:x", "a:0", "a,,b", "a,", "", "bad host:2", "a:2,:3"])
    def test_strict_errors_contain_spec(self, spec):
        with pytest.raises(HostSpecError) as err:
            parse_hosts_arg(spec, 1)
        assert repr(spec) in str(err.value)
        assert str(err.value).startswith("-H ")

    def test_error_names_the_bad_entry(self):
        with pytest.raises(HostSpecError) as err:
            parse_hosts_arg("good:1,worse:zero", 1)
        assert "'worse:zero'" in str(err.value) and "'zero'" in str(err.value)

    @pytest.mark.parametrize("spec,message", [
        ("bad host!", "-H 'bad host!' is not a valid host name"),
        ("bad host!:2", "-H 'bad host!:2': 'bad host!' is not a valid host name"),
        ("a,bad host!", "-H 'a,bad host!': 'bad host!' is not a valid host name"),
    ])
    def test_a_bad_host_is_named_once_per_layer(self, spec, message):
        with pytest.raises(HostSpecError) as err:
            parse_hosts_arg(spec, 1)
        assert str(err.value) == message

    @given(entries=st.lists(st.tuples(host_names, st.one_of(st.none(), slot_counts)), min_size=1, max_size=8,
                            unique_by=lambda e: e[0]),
           default=slot_counts)
    def test_property(self, entries, default):
        spec = ",".join(h if s is None else f"{h}:{s}" for h, s in entries)
        expected = {h: default if s is None else s for h, s in entries}
        assert parse_hosts_arg(spec, default) == expected


# --- parse_hostfile --------------------------------------------------------------------------
class TestParseHostfile:
    def test_all_three_forms(self):
        text = "a slots=4\nb:2\nc\n"
        assert parse_hostfile(text, 3) == {"a": 4, "b": 2, "c": 3}

    def test_slots_with_spaces_around_equals(self):
        assert parse_hostfile("a slots = 2\nb   slots=5\n", 1) == {"a": 2, "b": 5}

    def test_comments_and_blank_lines(self):
        text = "# cluster\n\na slots=2  # the big one\n   \n#b slots=9\nc:1\n"
        assert parse_hostfile(text, 1) == {"a": 2, "c": 1}

    def test_user_at_host(self):
        assert parse_hostfile("me@a slots=2\n", 1) == {"me@a": 2}

    def test_a_byte_order_mark_at_the_start_is_not_part_of_the_first_host(self):
        assert parse_hostfile("\ufeffa slots=2\r\nb:1\r\n", 1) == {"a": 2, "b": 1}

    def test_a_host_listed_twice_is_refused(self):
        with pytest.raises(HostSpecError, match=r"^my.hosts line 3: host 'a' is listed twice \(first on line 1\)$"):
            parse_hostfile("a slots=2\nb\na:6\n", 1, name="my.hosts")

    def test_absurd_slot_counts_are_refused(self):
        with pytest.raises(HostSpecError, match=f"^hostfile line 2: .* a host has at most {MAX_SLOTS_PER_HOST} slots"):
            parse_hostfile("a slots=2\nb slots=99999999999999999999\n", 1)
        assert parse_hostfile(f"a slots={MAX_SLOTS_PER_HOST}\n", 1) == {"a": MAX_SLOTS_PER_HOST}

    @pytest.mark.parametrize(
        "text, line, fragment",
        [
            ("a slots=x\n", 1, "not a whole number"),
            ("a\nb slots=0\n", 2, "at least 1 slot"),
            ("a\n\n# c\nb c d\n", 4, "not a valid host name"),
            ("a slot=2\n", 1, "not a valid host name"),
            ("a:1\nb:\n", 2, "not a whole number"),
        ],
    )
    def test_errors_name_file_and_line(self, text, line, fragment):
        with pytest.raises(HostSpecError) as err:
            parse_hostfile(text, 1, name="my.hosts")
        message = str(err.value)
        assert message.startswith(f"my.hosts line {line}:")
        assert fragment in message

    @pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
    def test_no_hosts(self, text):
        with pytest.raises(HostSpecError, match="hostfile: no hosts listed"):
            parse_hostfile(text, 1)

    def test_default_name_in_errors(self):
        with pytest.raises(HostSpecError, match=r"^hostfile line 1:"):
            parse_hostfile("a:0\n", 1)

    @given(
        entries=st.lists(st.tuples(host_names, st.one_of(st.none(), slot_counts), st.booleans()),
                         min_size=1, max_size=10, unique_by=lambda e: e[0]),
        default=slot_counts,
    )
    @settings(max_examples=200)
    def test_property(self, entries, default):
        lines = []
        expected: dict[str, int] = {}
        for host, slots, slots_form in entries:
            if slots is None:
                lines.append(host)
            elif slots_form:
                lines.append(f"{host} slots={slots}")
            else:
                lines.append(f"{host}:{slots}")
            expected[host] = default if slots is None else slots
        assert parse_hostfile("\n".join(lines), default) == expected


def test_draining_hosts_are_listed_and_marked():
    from elasticrun.common.hosts import parse_discovery_output

    r = parse_discovery_output("a:2\nb:4 draining\nc\tdraining  # reclaimed in 2 min\nd:1 leaving\n", 1)
    assert r.hosts == {"a": 2, "b": 4, "c": 1}
    assert r.draining == {"b", "c"}
    assert len(r.errors) == 1 and "expected `host[:slots]` or `host[:slots] draining`" in r.errors[0]
