"""``python -m wdsdist.tools.jpegcheck``: build (if needed) and load jpegcrop, the region decoder
(wdsdist/data/decode/jpegcrop.py), say which library loaded, and exit 1 where it cannot be used.
The image's build and deploy/check-image.sh run it, and so does the suite, so a module that moves
fails ``./run test`` before an image build. A tool, not the library: it prints."""

from __future__ import annotations

from wdsdist.data.decode import jpegcrop


def main() -> int:
    lib = jpegcrop.load()
    if isinstance(lib, str):
        print(f"jpegcrop is not usable: {lib}")
        return 1
    print(f"jpegcrop loaded: {lib._name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
