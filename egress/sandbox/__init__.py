"""What runs inside sandboxes: covey-request (the client of the proxy's request desk).

Python's standard library only, no Django: it is copied into covey's base image.
"""
