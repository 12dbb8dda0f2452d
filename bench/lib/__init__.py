"""The benches' library: what the runners in bench/ share (bench/__init__.py lists each module).
A runner imports from here only, never from another runner."""
