import hashlib
import math
from types import SimpleNamespace

import numpy as np
import pytest

from driftlab.randomness import Stream, generator
from driftlab.simulation.time.plan import DeviceProfile
from driftlab.simulation.time.profiles import LognormalProfiles, TraceProfiles, devices, profiles_for, read_trace

# ---------------------------------------------------------------- lognormal


def test_lognormal_profile_is_the_median_times_exp_sigma_z():
    z = generator(7, Stream.SYSTEM_PROFILE, 0, 3).standard_normal(3)
    profiles = LognormalProfiles(
        7, speed_median=100, speed_sigma=0.5, download_median=2e7, upload_median=5e6, bandwidth_sigma=0.25
    )
    assert profiles.profile(3, 0.0) == DeviceProfile(
        speed=100 * math.exp(0.5 * z[0]), download=2e7 * math.exp(0.25 * z[1]), upload=5e6 * math.exp(0.25 * z[2])
    )


def test_lognormal_profiles_do_not_depend_on_call_order_or_time():
    a = LognormalProfiles(1, speed_sigma=0.7)
    b = LognormalProfiles(1, speed_sigma=0.7)
    forward = [a.profile(k, 0.0) for k in range(20)]
    backward = [b.profile(k, 1e6) for k in reversed(range(20))][::-1]
    assert forward == backward
    assert len({p.speed for p in forward}) == 20  # distinct clients, distinct devices
    assert LognormalProfiles(2, speed_sigma=0.7).profile(0, 0.0) != forward[0]  # another seed, another device


def test_zero_sigma_gives_the_medians_and_whole_availability():
    profiles = LognormalProfiles(
        0, speed_median=50, speed_sigma=0, download_median=8, upload_median=4, bandwidth_sigma=0
    )
    assert profiles.profile(12, 3.0) == DeviceProfile(50.0, 8.0, 4.0, 0.0, math.inf)
    assert profiles.available(np.arange(5), 123.0).tolist() == [True] * 5


def test_lognormal_medians_are_the_draws_medians():
    speeds = [LognormalProfiles(3).profile(k, 0).speed for k in range(2001)]
    assert 90 < float(np.median(speeds)) < 110  # median 100, σ 0.5: the sample median of 2001 is within a few %


@pytest.mark.parametrize(
    "field, value", [("speed_median", 0.0), ("upload_median", math.inf), ("bandwidth_sigma", -1.0)]
)
def test_lognormal_bad_parameters_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        LognormalProfiles(0, **{field: value})


# ---------------------------------------------------------------- traces


def write(tmp_path, text, name="trace.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_trace_windows(tmp_path):
    path = write(
        tmp_path,
        "client,speed,download,upload,start,end\n"
        "1,5,100,10,50,\n"  # an empty end: to the end of the run
        "0,10,1000,100,0,10\n"
        "0,20,2000,200,20,30\n",
    )
    trace = read_trace(path, 2)
    assert trace.profile(0, 0.0) == DeviceProfile(10.0, 1000.0, 100.0, 0.0, 10.0)
    assert trace.profile(0, 9.999) == DeviceProfile(10.0, 1000.0, 100.0, 0.0, 10.0)
    assert trace.profile(0, 10.0) is None  # [start, end): the end is outside
    assert trace.profile(0, 25.0) == DeviceProfile(20.0, 2000.0, 200.0, 20.0, 30.0)
    assert trace.profile(0, 30.0) is None
    assert trace.profile(1, 49.0) is None
    assert trace.profile(1, 1e9) == DeviceProfile(5.0, 100.0, 10.0, 50.0, math.inf)
    assert trace.available(np.array([0, 1]), 5.0).tolist() == [True, False]
    assert trace.available(np.array([1, 0, 1]), 60.0).tolist() == [True, False, True]
    assert trace.available(np.array([0, 1]), 25.0).tolist() == [True, False]
    assert trace.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert trace.source == str(path)


def test_touching_windows_are_one_stretch_of_availability(tmp_path):
    # client 0's device slows at t = 10 and stays until 30, then leaves; it comes back at 40 for good
    path = write(
        tmp_path,
        "client,speed,download,upload,start,end\n0,10,1000,100,0,10\n0,5,1000,100,10,30\n0,7,1000,100,40,\n",
    )
    trace = read_trace(path, 1)
    assert trace.profile(0, 3.0) == DeviceProfile(10.0, 1000.0, 100.0, 0.0, 30.0)  # work begun at 3 may run to 30
    assert trace.profile(0, 12.0) == DeviceProfile(5.0, 1000.0, 100.0, 10.0, 30.0)
    assert trace.profile(0, 35.0) is None
    assert trace.profile(0, 41.0) == DeviceProfile(7.0, 1000.0, 100.0, 40.0, math.inf)


def test_trace_without_windows_is_always_available(tmp_path):
    trace = read_trace(
        write(tmp_path, "upload, download ,speed,Client\n4,3,2,1\n8,7,6,0\n"), 2
    )  # any order, spaces, case
    assert trace.profile(0, 0.0) == DeviceProfile(6.0, 7.0, 8.0)
    assert trace.profile(1, 1e12) == DeviceProfile(2.0, 3.0, 4.0)
    assert trace.available(np.array([0, 1]), 1e12).all()


def test_available_agrees_with_profile(tmp_path):
    rng = np.random.default_rng(0)
    lines = ["client,speed,download,upload,start,end"]
    for k in range(50):
        edges = np.sort(rng.choice(100, size=4, replace=False))
        lines += [f"{k},1,1,1,{edges[0]},{edges[1]}", f"{k},2,2,2,{edges[2]},{edges[3]}"]
    trace = read_trace(write(tmp_path, "\n".join(lines) + "\n"), 50)
    ids = rng.permutation(50)
    for t in np.linspace(-1, 101, 67):
        expected = [trace.profile(int(k), float(t)) is not None for k in ids]
        assert trace.available(ids, float(t)).tolist() == expected


def test_a_large_shuffled_trace_gives_every_client_its_own_row(tmp_path):
    # 100,000 clients written in a random order: sorting by (client, start) must keep each client's own values. (How
    # fast it loads is a benchmark's question, never a timed test's.)
    n = 100_000
    rng = np.random.default_rng(1)
    order = rng.permutation(n)
    speeds = np.round(rng.uniform(1, 100, n), 3)
    text = "client,speed,download,upload,start,end\n" + "".join(
        f"{k},{s:.3f},2e7,5e6,0,1e6\n" for k, s in zip(order.tolist(), speeds.tolist(), strict=True)
    )
    trace = read_trace(write(tmp_path, text), n)
    np.testing.assert_array_equal(trace.client, np.arange(n))
    expected = np.empty(n)
    expected[order] = speeds
    np.testing.assert_array_equal(trace.speed, expected)
    assert trace.profile(int(order[7]), 5.0).speed == speeds[7]
    assert trace.available(np.arange(n), 5.0).all()
    assert not trace.available(np.arange(n), 1e6).any()  # every window ends there


@pytest.mark.parametrize(
    "text, message",
    [
        ("", r"is empty"),
        ("\n\n", r"is empty"),
        ("client,speed,download,upload\n", r"has a header but no rows"),
        (
            "client,speed,download,upload,bandwidth\n0,1,1,1,1\n",
            r"line 1: unknown column\(s\) 'bandwidth'; a trace's columns are client, speed",
        ),
        ("client,speed,download\n0,1,1\n", r"line 1: no column 'upload'"),
        ("client,speed,speed,download,upload\n0,1,1,1,1\n", r"speed named twice"),
        ("client,speed,download,upload\n0,1,1\n", r"line 2: 3 values for the header's 4 columns"),
        ("client,speed,download,upload\n0,fast,1,1\n", r"line 2, column 'speed': is not a number \(got 'fast'\)"),
        ("client,speed,download,upload\n0,1,,1\n", r"line 2, column 'download': is not a number \(got ''\)"),
        (
            "client,speed,download,upload\n0,1,1,1\n1,nan,1,1\n",
            r"line 3, column 'speed': is not a number \(got 'nan'\)",
        ),
        (
            "client,speed,download,upload\n\n0,1,1,1\n\n1,1,x,1\n",
            r"line 5, column 'download': is not a number",
        ),  # blank lines count
        ("client,speed,download,upload\n0,0,1,1\n", r"line 2, column 'speed': must be a positive finite number"),
        ("client,speed,download,upload\n0,1,1,-5\n", r"line 2, column 'upload': must be a positive finite number"),
        ("client,speed,download,upload\n0,1,inf,1\n", r"line 2, column 'download': must be a positive finite number"),
        (
            "client,speed,download,upload\n0,1,1,1\n2.0,1,1,1\n",
            r"line 3, column 'client': must be a client id, an integer in 0..1 \(got '2.0'\)",
        ),
        ("client,speed,download,upload\n0,1,1,1\n2,1,1,1\n", r"line 3, column 'client': must be a client id"),
        ("client,speed,download,upload\n-1,1,1,1\n", r"line 2, column 'client': must be a client id"),
        (
            "client,speed,download,upload,start,end\n0,1,1,1,5,5\n1,1,1,1,,\n",
            r"line 2, column 'end': must be larger than start",
        ),
        (
            "client,speed,download,upload,start\n0,1,1,1,-1\n1,1,1,1,0\n",
            r"line 2, column 'start': must be a finite number of seconds",
        ),
        (
            "client,speed,download,upload,start,end\n0,1,1,1,0,10\n1,1,1,1,,\n0,1,1,1,5,20\n",
            r"line 4, column 'start': client 0's window \[5, 20\) overlaps its window \[0, 10\) of line 2",
        ),
        (
            "client,speed,download,upload,start,end\n0,1,1,1,5,20\n1,1,1,1,,\n0,1,1,1,0,10\n",
            r"line 4, column 'start': client 0's window \[0, 10\) overlaps its window \[5, 20\) of line 2",
        ),
        (
            "client,speed,download,upload\n0,1,1,1\n",
            r"1 of the data set's 2 clients have no row \(client 1\); give every client 0..1",
        ),
    ],
)
def test_trace_errors_name_the_file_line_column_and_fix(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as caught:
        read_trace(path, 2)
    assert str(path) in str(caught.value)


def test_missing_clients_are_counted_and_the_first_listed(tmp_path):
    path = write(tmp_path, "client,speed,download,upload\n3,1,1,1\n")
    with pytest.raises(
        ValueError, match=r"9 of the data set's 10 clients have no row \(client 0, 1, 2, 4, 5, \.\.\.\)"
    ):
        read_trace(path, 10)


def test_an_unreadable_trace(tmp_path):
    with pytest.raises(ValueError, match="cannot read the trace .*nowhere.csv.*system.trace"):
        read_trace(tmp_path / "nowhere.csv", 1)
    (tmp_path / "latin1.csv").write_bytes(b"client,speed,download,upload\n0,1,1,1\xe9\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_trace(tmp_path / "latin1.csv", 1)


def test_quoted_cells_and_line_ends_read_alike(tmp_path):
    plain = read_trace(write(tmp_path, "client,speed,download,upload,end\n1,2.5,3,4,9\n0,5,6,7,\n"), 2)
    quoted = read_trace(
        write(tmp_path, '\r\n"client","speed",download,upload,end\r\n\r\n"1","2.5",3,4,9\r\n0,5,6,7,""\r\n', "q.csv"), 2
    )
    for name in ("client", "speed", "download", "upload", "start", "end"):
        assert getattr(plain, name).tolist() == getattr(quoted, name).tolist()
    with pytest.raises(ValueError, match=r"line 4, column 'upload': is not a number \(got 'x'\)"):
        read_trace(write(tmp_path, '\n"client",speed,download,upload\n0,1,1,1\n"1",1,1,x\n', "bad.csv"), 2)
    with pytest.raises(ValueError, match=r"line 3: 5 values for the header's 4 columns"):
        read_trace(write(tmp_path, "client,speed,download,upload\n0,1,1,1\n1,1,1,1,1\n", "ragged.csv"), 2)


def test_a_byte_order_mark_is_not_part_of_the_header(tmp_path):
    (tmp_path / "bom.csv").write_bytes("\ufeffclient,speed,download,upload\n0,1,2,3\n".encode())
    assert read_trace(tmp_path / "bom.csv", 1).profile(0, 0.0) == DeviceProfile(1.0, 2.0, 3.0)


def test_trace_profiles_refuse_unsorted_rows():
    one = np.ones(2)
    with pytest.raises(ValueError, match="sorted"):
        TraceProfiles(np.array([1, 0]), one, one, one, np.zeros(2), np.full(2, math.inf), 2)


# ---------------------------------------------------------------- from a config


def system(**keys):
    defaults = dict(
        profiles="lognormal",
        speed_median=100.0,
        speed_sigma=0.5,
        download_median=2e7,
        upload_median=5e6,
        bandwidth_sigma=0.5,
        trace=None,
    )
    return SimpleNamespace(**{**defaults, **keys})


def test_profiles_for_lognormal():
    profiles = profiles_for(system(speed_median=40.0), seed=5, num_clients=3)
    assert profiles == LognormalProfiles(5, 40.0, 0.5, 2e7, 5e6, 0.5)


def test_profiles_for_trace(tmp_path):
    path = write(tmp_path, "client,speed,download,upload\n0,1,2,3\n")
    profiles = profiles_for(system(profiles="trace", trace=str(path)), seed=5, num_clients=1)
    assert profiles.profile(0, 0.0) == DeviceProfile(1.0, 2.0, 3.0)
    with pytest.raises(ValueError, match="unknown profiles 'measured'"):
        profiles_for(system(profiles="measured"), seed=5, num_clients=1)


def test_devices_lists_every_client_or_every_trace_window(tmp_path):
    lognormal = LognormalProfiles(4)
    assert [(k, p) for k, p in devices(lognormal, 3)] == [(k, lognormal.profile(k, 0.0)) for k in range(3)]
    path = write(
        tmp_path, "client,speed,download,upload,start,end\n1,5,100,10,50,\n0,10,1000,100,0,10\n0,20,2000,200,20,30\n"
    )
    assert [(k, p.speed, p.start) for k, p in devices(read_trace(path, 2), 2)] == [
        (0, 10.0, 0.0),
        (0, 20.0, 20.0),
        (1, 5.0, 50.0),
    ]
