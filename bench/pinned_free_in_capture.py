"""Diagnostic: does freeing a pinned block, last used on a stream, while that stream is
being captured leave an event torch's caching host allocator later fails to query ("CUDA error: invalid argument"
at the next pinned allocation or `.item()`)? Run on a GPU: `python bench/pinned_free_in_capture.py`."""

import torch


def probe(label: str) -> None:
    errors = 0
    for _ in range(4):
        try:
            torch.empty(1, pin_memory=True)
            torch.ones(1, device="cuda").sum().item()
        except Exception as error:  # noqa: BLE001 - printing what the allocator raises is the point
            errors += 1
            message = str(error).splitlines()[0]
    print(f"{label:60s} errors in 4 probes: {errors}" + (f" ({message})" if errors else ""), flush=True)


def case(side_captured: bool, stream_used: str) -> None:
    side, capture = torch.cuda.Stream(), torch.cuda.Stream()
    host = torch.empty(1 << 20, pin_memory=True)
    used = side if stream_used == "side" else torch.cuda.current_stream()
    with torch.cuda.stream(used):
        device = host.to("cuda", non_blocking=True)  # the allocator notes `used` on the host block
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(capture):
        graph.capture_begin(capture_error_mode="relaxed")
        if side_captured:
            side.wait_stream(capture)
            with torch.cuda.stream(side):
                out = device * 2
            capture.wait_stream(side)
        else:
            out = device * 2
        del host  # freed while the capture runs
        graph.capture_end()
    graph.replay()
    torch.cuda.synchronize()
    probe(f"side captured={side_captured}, block used on {stream_used}")


if __name__ == "__main__":
    probe("before")
    case(False, "side")
    case(True, "current")
    case(True, "side")
    case(True, "side")
