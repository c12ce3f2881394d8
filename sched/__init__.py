"""dtfm.sched"""
