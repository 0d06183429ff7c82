"""pdserve.transfer"""
