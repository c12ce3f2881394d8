"""dtfm.train"""
