"""Peer serving systems (Ray Serve, Infinity), each run from its own virtualenv in bench/.peers/."""
