"""pdserve.model"""
